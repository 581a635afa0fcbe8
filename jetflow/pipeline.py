"""``JetFlow``: a target plus (optionally) a draft head, behind one generate/stream API."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from jetflow.decoding.api import check_request_options, prepare_request
from jetflow.decoding.autoregressive import autoregressive_stream
from jetflow.decoding.budget import AdaptiveBudget
from jetflow.decoding.costs import CostCurve, cached_costs
from jetflow.decoding.drafter import Drafter, make_drafter
from jetflow.decoding.result import GenerationResult
from jetflow.decoding.speculative import speculative_stream
from jetflow.errors import InvalidRequestError, RequestSupersededError
from jetflow.models.backend import TargetBackend
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead
from jetflow.models.loading import default_device_and_dtype, load_target
from jetflow.models.shipped import shipped_drafter
from jetflow.utils.fs import cache_root, write_json_atomic

# The default budget on a GPU (not re-measured against 'auto' there).
DEFAULT_BUDGET = 16
# On the CPU 'auto': there a verify's cost grows with its tokens from the second or third on, so
# the best tree is small and moves with the text (torch, 2-core EPYC: `auto` 1.36x / 1.66x faster
# than budget 16 on GSM8K / MT-Bench; llama.cpp: a 2-token verify costs 1.8 steps and no fixed
# budget pays, while 'auto' falls back to plain steps; docs/results.md).
DEFAULT_CPU_BUDGET = "auto"
# The largest fixed budget: the method's range (16..256), and what llama.cpp verifies in one decode
# (a tree of n nodes has at most n root-to-leaf paths; llama.cpp takes 256 sequences).
MAX_BUDGET = 256
DEFAULT_WIDTH = 7


class JetFlow:
    def __init__(self, target: TargetBackend, head: DraftHead | None = None, *, budget: int | str | None = None,
                 width: int = DEFAULT_WIDTH, cost_cache: str | Path | None = None, int8_draft: bool | None = None,
                 lookup: bool = True, drafter: Drafter | None = None, refine: bool | int | str | None = None,
                 auto_state: str | Path | None = None):
        """``head``: a draft head to run; or ``drafter``: a ready :class:`Drafter` (e.g. prompt lookup).
        ``lookup``: merge prompt-lookup candidates into the head's trees (decoding/mixed_drafter.py).
        ``refine``: a block head's path-conditioned second pass (decoding/refine.py; an int N: N such
        passes; "tree" or "tree:N": passes conditioning every node of the tree); None: one when the
        head was trained for it. ``auto_state``: a directory where ``budget="auto"`` keeps what it
        learns (acceptance, costs, whether the head pays) from one process to the next, per machine
        curve and head; None (the default): each decoder starts from nothing."""
        self.target = target
        self.auto_state = Path(auto_state) if auto_state is not None else None
        self._state_path: Path | None = None
        # The lean draft (int8 weights) by default on the CPU: on llama.cpp a decoding step is a few ms
        # and an fp32 head forward would cost more than the step; on torch it drafts in 2.5 ms where
        # fp32 took 5-14, and `auto` ran 1.04-1.10x faster with it (docs/results.md).
        self.int8_draft = target.device.type == "cpu" if int8_draft is None else int8_draft
        self.lookup = lookup and head is not None
        self.drafter = (make_drafter(head, target, int8=self.int8_draft, lookup=self.lookup, refine=refine)
                        if head is not None else drafter)
        if budget is None:
            budget = DEFAULT_CPU_BUDGET if target.device.type == "cpu" else DEFAULT_BUDGET
            if self._headless and budget == "auto":  # `auto` prices a head's drafts: a chain drafter offers its whole chain
                budget = getattr(self.drafter, "max_draft", DEFAULT_BUDGET)
        self.budget, self.width = _check_tree_args(budget, width)
        self._check_auto(self.budget)
        self.drafter_path: str | None = None  # where the head was loaded from, if from disk
        self.cost_cache = Path(cost_cache) if cost_cache else cache_root() / "costs"
        self._adaptive: AdaptiveBudget | None = None
        # One request at a time: every request shares the target's KV cache and the drafter's
        # context. A lock keeps two threads' steps from running at once (two llama.cpp decodes at
        # once abort the process), and a newer request makes older streams refuse to go on.
        self._lock = threading.Lock()
        self._requests = 0

    @property
    def _headless(self) -> bool:
        """A drafter without a draft head (prompt lookup alone)."""
        return self.drafter is not None and getattr(self.drafter, "head", None) is None

    def _check_auto(self, budget) -> None:
        if budget == "auto" and self._headless:
            raise InvalidRequestError(f"budget 'auto' prices a draft head's trees; this decoder's drafter "
                                      f"({type(self.drafter).__name__}) has none: give a fixed budget")

    def adaptive_budget(self) -> AdaptiveBudget:
        """The budget chooser of ``budget="auto"``: made on first use from the machine's cost curve
        (measured once, then read from ``cost_cache``); its acceptance counts persist across calls."""
        if self._adaptive is None:
            costs = cached_costs(self.target, self.drafter, self.cost_cache, width=self.width,
                                 log=lambda m: print(f"jetflow: {m}", file=sys.stderr))
            self._adaptive = AdaptiveBudget(CostCurve(costs), max_budget=max(costs["verify_ms"]))  # (sizes measured)
            if self.auto_state is not None:
                name = f"auto-state-{costs['cache_digest']}-{_head_digest(self.drafter.head)}.json"
                self._state_path = self.auto_state / name
                self._load_auto_state()
        return self._adaptive

    def _load_auto_state(self) -> None:
        """What ``auto`` learned in an earlier process, if saved; a damaged file is ignored (and
        replaced after the next request)."""
        path = self._state_path
        if not path.is_file():
            return
        try:
            self._adaptive.load_state(json.loads(path.read_text())["state"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # (json's errors are ValueErrors)
            print(f"jetflow: ignoring the saved 'auto' state {path}: {e}", file=sys.stderr)

    def _saving_auto_state(self, events: Iterator[str | GenerationResult]) -> Iterator[str | GenerationResult]:
        for event in events:
            if isinstance(event, GenerationResult):  # the request is over: save, then hand over its result
                try:
                    # (no fsync: after every request, and a damaged state is dropped on load)
                    write_json_atomic(self._state_path, {"state": self._adaptive.state()}, durable=False)
                except OSError as e:  # the request's output matters more than what `auto` learned from it
                    print(f"jetflow: could not save the 'auto' state to {self._state_path}: {e}", file=sys.stderr)
            yield event

    @classmethod
    def from_pretrained(cls, target: str | TargetBackend | None = None, drafter: str | Path | DraftHead | None = None,
                        *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                        backend: str = "auto", n_threads: int | None = None, flash_attn: bool = False,
                        **defaults) -> "JetFlow":
        """``target``: any model spec (see :func:`jetflow.resolve_model`) or a loaded target (on
        ``device``, default cuda when there is one, else cpu; ``dtype``, default float32 on the CPU,
        bfloat16 on a GPU);
        ``backend``: "torch", "llamacpp" (GGUF targets) or "auto" (see jetflow/models/loading.py);
        ``flash_attn``: llama.cpp's fused attention kernel (off by default: faster, but its one-row and
        many-row kernels sum in different orders, so outputs may differ from one-token decoding).
        ``drafter``: a checkpoint directory, a DraftHead, None/"none" for plain decoding, or "auto":
        the drafter shipped with JetFlow for this target when there is one."""
        if target is None or isinstance(target, (str, Path)):
            device, dtype = default_device_and_dtype(device, dtype, backend)
            target = load_target(target, backend=backend, device=device, dtype=dtype, n_threads=n_threads,
                                 flash_attn=flash_attn)
        head, path = drafter, None
        if isinstance(drafter, str) and drafter.lower() == "auto":
            drafter = shipped_drafter(target.name)
        if drafter is None or isinstance(drafter, str) and drafter.lower() == "none":
            head = None
        elif isinstance(drafter, (str, Path)):
            path = str(drafter)
            head = load_drafter(drafter, target=target, device=target.device)
        if head is not None:
            head = head.to(device=target.device, dtype=target.dtype)  # shipped bf16 -> the target's dtype
        jf = cls(target, head, **defaults)
        jf.drafter_path = path
        return jf

    def stream(self, prompt, *, budget: int | None = None, width: int | None = None, every_round: bool = False,
               **request) -> Iterator[str | GenerationResult]:
        """Yield text deltas, then the :class:`GenerationResult` (with tau/rounds in ``stats``).
        Request keywords: max_new_tokens, temperature, top_k, top_p, seed, stop, chat; ``budget`` and
        ``width`` override the decoder's for this request. ``every_round``: a delta before every
        decoding round, empty while no text is final (held back for a stop string or an incomplete
        character), so a caller can stop the stream between any two rounds (the server's cancel)."""
        budget, width = _check_tree_args(self.budget if budget is None else budget,
                                         self.width if width is None else width)
        self._check_auto(budget)
        check_request_options(request, also=("budget", "width", "stream (generate)"))
        prompt_ids, params, output = prepare_request(self.target, prompt, **request)
        with self._lock:
            if budget == "auto" and self.drafter is not None:
                budget = self.adaptive_budget()
            self._requests += 1
            ticket = self._requests
        if self.drafter is None:
            events = autoregressive_stream(self.target, prompt_ids, params, output, every_round)
        else:
            events = speculative_stream(self.target, self.drafter, prompt_ids, params, output, budget, width,
                                        every_round)
            if isinstance(budget, AdaptiveBudget) and self._state_path:
                events = self._saving_auto_state(events)
        return self._one_at_a_time(events, ticket)

    def _one_at_a_time(self, events: Iterator[str | GenerationResult], ticket: int) -> Iterator[str | GenerationResult]:
        """``events``, each step taken under the lock, and refused once a newer request has started
        (the state it would go on from is no longer its own)."""
        while True:
            with self._lock:
                if ticket != self._requests:
                    raise RequestSupersededError(
                        "this stream was superseded: a newer request started on the same JetFlow, which runs one "
                        "request at a time (finish a stream before starting the next; for concurrent requests use "
                        "one JetFlow per thread, or `jetflow serve`)")
                try:
                    event = next(events)
                except StopIteration:
                    return
            yield event

    def generate(self, prompt, *, stream: bool = False, **kwargs):
        """A :class:`GenerationResult`, or with ``stream=True`` the iterator of :meth:`stream`."""
        events = self.stream(prompt, **kwargs)
        if stream:
            return events
        *_, result = events
        return result



def _head_digest(head: DraftHead) -> str:
    """Names a head's weights: what `auto` learned about one head says nothing about another."""
    h = hashlib.sha1()
    for name, tensor in sorted(head.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _check_tree_args(budget, width) -> tuple[int | str, int]:
    if budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= MAX_BUDGET):
        raise InvalidRequestError(f"budget must be an integer in [0, {MAX_BUDGET}] (draft nodes per round) or 'auto', "
                                  f"got {budget!r}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise InvalidRequestError(f"width must be an integer >= 1, got {width!r}")
    return budget, width
