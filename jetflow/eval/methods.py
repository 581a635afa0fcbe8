"""The decoding methods the benchmark compares, on the same prompts.

    ar             JetFlow's own autoregressive loop on the target's backend (the speed-up
                   denominator on the torch backend)
    llama-ar       llama-cpp-python's own ``Llama`` greedy loop (llama.cpp backend only: in a greedy
                   run the speed-up denominator and the output every llama.cpp method must equal;
                   a sampled run, which it cannot decode, measures against ar)
    hf             plain transformers ``generate`` (what a user gets without JetFlow; torch only)
    pld            transformers prompt-lookup decoding (no drafter; torch only)
    lookup         JetFlow's prompt lookup (no drafter) through the tree verifier: any backend
    torch-ar       JetFlow's autoregressive loop on the torch backend of the same model, and
    torch-jetflow  the causal head there: in a llama.cpp run, "JetFlow as it was" side by side
                   (their outputs are compared with torch-ar, their speed with the denominator)
    dflash         bidirectional head, chain (width 1, one path of block_size - 1 drafts)
    ddtree         bidirectional head, best-first tree
    jetflow        causal head, best-first tree
    jetflow-lookup causal head and prompt lookup merged into one tree (JetFlow's default drafting;
                   with a head trained for it, its path-conditioned passes too, as jetflow-refine)
    jetflow-chain  causal head, chain
    jetflow-refine causal head trained with revealed blocks (``train --reveal``), best-first tree
                   over its first pass and its path-conditioned second pass (decoding/refine.py);
                   ``jetflow`` runs the same head's first pass alone
    eagle3         EAGLE-3-style autoregressive head, dynamic tree (one head forward per depth)
    eagle3-lookup  the EAGLE-3-style head's tree with prompt lookup merged in (as jetflow-lookup)
    llama-dflash   llama.cpp's own speculative driver (``llama-speculative-simple``, ``make
                   llama-tools``) with a DFlash-compatible causal head exported by ``export-gguf``:
                   chain drafts of 3 tokens, the driver's default (llama.cpp only). The driver prints
                   text, so its output is compared with llama-ar's as text (its token ids are that
                   text tokenized again); its time is the driver's prompt + decode time.

Every method returns a :class:`GenerationResult` whose ``stats`` hold ``rounds`` (target forwards
after the prefill) and, for the drafters, ``accept_lengths`` per round (bonus token included).
"""

from __future__ import annotations

import copy
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig

import jetflow
from jetflow.decoding.api import prepare_request
from jetflow.decoding.result import GenerationResult
from jetflow.decoding.sampling import SamplingParams
from jetflow.errors import JetFlowError
from jetflow.decoding.lookup_drafter import LookupDrafter
from jetflow.models.backend import TargetBackend
from jetflow.models.draft_head import DraftHead
from jetflow.models.resolve import is_known_model

PLD_TOKENS = 10  # prompt-lookup candidates per step (transformers' usual setting)
NATIVE_DRAFT = 3  # llama-dflash draft length: llama.cpp's own default (--spec-draft-n-max); 15 runs at 0.2x here


@dataclass(frozen=True)
class MethodSpec:
    name: str
    head: str | None  # the head it needs: "causal" / "bidirectional" block head, "eagle3", or None
    tree: bool  # True: the --budgets sweep applies; False: one run
    backend: str | None = None  # None: the bench target's; "torch": a torch twin of it; "llamacpp": only there
    equals: str | None = None  # the method whose output it must reproduce (None: the run's reference)
    exact_tokens: bool = True  # False: its tokens are its text tokenized again, so outputs compare as text
    greedy_only: bool = False  # decodes greedily whatever the temperature: refused in a sampled run


METHODS = {m.name: m for m in [
    MethodSpec("ar", None, False), MethodSpec("hf", None, False), MethodSpec("pld", None, False),
    MethodSpec("dflash", "bidirectional", False), MethodSpec("ddtree", "bidirectional", True),
    MethodSpec("jetflow", "causal", True), MethodSpec("jetflow-chain", "causal", False),
    MethodSpec("jetflow-lookup", "causal", True), MethodSpec("jetflow-refine", "causal", True),
    MethodSpec("eagle3", "eagle3", True), MethodSpec("eagle3-lookup", "eagle3", True),
    MethodSpec("llama-ar", None, False, backend="llamacpp", greedy_only=True),
    MethodSpec("lookup", None, False), MethodSpec("torch-ar", None, False, backend="torch", equals="torch-ar"),
    MethodSpec("torch-jetflow", "causal", False, backend="torch", equals="torch-ar"),
    MethodSpec("llama-dflash", None, False, backend="llamacpp", exact_tokens=False, greedy_only=True),
]}


def reference_method(target, greedy: bool = True) -> str:
    """The method every speed-up is measured against and every output compared with: on llama.cpp
    llama-cpp-python's own greedy loop, except in a sampled run (``greedy`` False), which it cannot
    decode; JetFlow's plain loop then, as on torch."""
    return "llama-ar" if target.backend == "llamacpp" and greedy else "ar"


HEAD_FLAGS = {"causal": "--drafter", "bidirectional": "--baseline-drafter", "eagle3": "--eagle-drafter"}


def check_sampling(methods: list[MethodSpec], greedy: bool) -> None:
    """JetFlowError naming the methods a sampled run cannot measure (they decode greedily only)."""
    refused = [m.name for m in methods if m.greedy_only]
    if not greedy and refused:
        raise JetFlowError(f"{', '.join(refused)} decode{'s' if len(refused) == 1 else ''} greedily only: drop "
                           f"{'it' if len(refused) == 1 else 'them'} from --methods to measure a temperature above 0 "
                           "(a sampled run on llama.cpp compares with ar)")


def parse_methods(text: str, reference: str = "ar") -> list[MethodSpec]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise JetFlowError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(METHODS)}")
    needed = [reference] + [METHODS[n].equals for n in names if METHODS[n].equals]
    names = [n for n in needed if n not in names] + names  # references run first on each dataset
    return [METHODS[n] for n in dict.fromkeys(names)]


class MethodRunner:
    """Runs one method on one prompt. Heads are given per attention kind; a method whose head kind
    is missing, has the wrong attention, or needs another backend is refused up front."""

    def __init__(self, target: TargetBackend, heads: dict[str, DraftHead], width: int = 7,
                 native_drafter: str | Path | None = None, refine: int | str = 1, int8_draft: bool | None = None):
        """``int8_draft``: the heads' weights as int8 (None: the decoder's default for the target)."""
        self.target, self.width, self.heads, self.int8_draft = target, width, heads, int8_draft
        # Every method prefills every prompt in full, as llama-ar's reference does: one method's KV
        # must not hand the next the same prompt for free.
        target.prefix_cache = False
        self.refine = refine  # the second pass of jetflow-refine: passes, or "tree"
        self.native_drafter = native_drafter  # checkpoint dir llama-dflash exports and runs
        self._native_gguf = None
        self.decoders = {}
        for kind, head in heads.items():
            have = "eagle3" if head.kind == "eagle3" else head.config.attention
            if have != kind:
                raise JetFlowError(f"the {kind} methods need a {kind} head; the given one ({HEAD_FLAGS[kind]}) "
                                   f"is {have}")
            self.decoders[kind] = jetflow.JetFlow(target, head.to(device=target.device, dtype=target.dtype),
                                                  lookup=False, refine=False, int8_draft=int8_draft)
        self._mixed = {}  # (head kind, budget) -> its decoder with prompt lookup merged in (jetflow-lookup, eagle3-lookup)
        self._lookup = None
        self._refined = None  # the causal head with its path-conditioned pass (jetflow-refine)
        self._llama = None  # llama-cpp-python's Llama on the same GGUF (llama-ar)
        self._torch = None  # (torch twin target, its causal-head decoder or None)

    def draft_weights(self) -> str:
        """"int8" where a block head drafts with int8 weights, else "float" (EAGLE heads always do)."""
        return "int8" if any(getattr(d.drafter, "int8", False) for d in self.decoders.values()) else "float"

    def check(self, spec: MethodSpec) -> None:
        if spec.head is not None and spec.head not in self.decoders:
            raise JetFlowError(f"method {spec.name!r} needs a {spec.head} draft head: pass {HEAD_FLAGS[spec.head]}")
        if spec.name in ("hf", "pld") and self.target.backend != "torch":
            raise JetFlowError(f"method {spec.name!r} is transformers' generate: it needs --backend torch")
        if spec.backend == "llamacpp" and self.target.backend != "llamacpp":
            raise JetFlowError(f"method {spec.name!r} needs the llama.cpp backend (--backend llamacpp)")
        if spec.name == "jetflow-refine" and not self.heads["causal"].config.path_refine:
            raise JetFlowError("method 'jetflow-refine' needs a head trained for the path-conditioned pass "
                               "(`jetflow train --reveal P`); the given --drafter was not")
        if spec.name == "llama-dflash":
            from jetflow.eval.llama_tools import find_llama_tools

            if find_llama_tools() is None:
                raise JetFlowError("method 'llama-dflash' needs llama.cpp's speculative driver: run `make llama-tools` "
                                   "or set JETFLOW_LLAMA_TOOLS to the directory holding llama-speculative-simple")
            if self.native_drafter is None:
                raise JetFlowError("method 'llama-dflash' needs a DFlash-compatible causal head: pass --native-drafter")

    def run(self, spec: MethodSpec, prompt, *, budget: int | None, max_new_tokens: int,
            temperature: float = 0.0, seed: int | None = None, chat: bool = True) -> GenerationResult:
        request = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, chat=chat)
        if spec.name in ("ar", "torch-ar"):
            target = self.target if spec.name == "ar" else self._torch_twin()[0]
            result = jetflow.generate(target, prompt, **request)
            result.stats = {"rounds": max(0, result.new_tokens - 1)}
            return result
        if spec.name in ("hf", "pld"):
            return self._hf_generate(prompt, spec.name, request)
        if spec.name == "llama-ar":
            return self._llama_generate(prompt, request)
        if spec.name == "llama-dflash":
            return self._native_generate(prompt, request)
        if spec.name == "lookup":
            if self._lookup is None:
                self._lookup = jetflow.JetFlow(self.target, drafter=LookupDrafter(self.target))
            return self._lookup.generate(prompt, budget=self._lookup.drafter.max_draft, width=1, **request)
        if spec.name == "torch-jetflow":
            decoder = self._torch_twin()[1]
        elif spec.name in ("jetflow-lookup", "eagle3-lookup"):
            # As the default decoder: with the head's second pass if it has one. One per budget: its
            # lookup counts price its chains, and budgets timed side by side must not train each other's.
            if (spec.head, budget) not in self._mixed:
                head = self.decoders[spec.head].drafter.head
                self._mixed[spec.head, budget] = jetflow.JetFlow(
                    self.target, head, lookup=True, int8_draft=self.int8_draft,
                    refine=self.refine if head.config.path_refine else 0)
            decoder = self._mixed[spec.head, budget]
        elif spec.name == "jetflow-refine":
            if self._refined is None:
                self._refined = jetflow.JetFlow(self.target, self.decoders["causal"].drafter.head, lookup=False,
                                                refine=self.refine, int8_draft=self.int8_draft)
            decoder = self._refined
        else:
            decoder = self.decoders[spec.head]
        decoder.target.set_tapped_layers(decoder.drafter.head.config.target_layer_ids)  # heads may read other layers
        if spec.name == "torch-jetflow":  # at the torch runtime's own default budget
            return decoder.generate(prompt, width=self.width, **request)
        if spec.tree:
            return decoder.generate(prompt, budget=budget, width=self.width, **request)
        return decoder.generate(prompt, budget=decoder.drafter.block_size - 1, width=1, **request)

    def _torch_twin(self):
        """The same model on the torch backend (loaded on first use), with the causal head."""
        if self._torch is None:
            if self.target.backend == "torch":
                self._torch = (self.target, self.decoders.get("causal"))
            else:
                from jetflow.models.target import TargetModel

                spec = self.target.name if is_known_model(self.target.name) else str(self.target.gguf)
                twin = TargetModel.load(spec)
                twin.prefix_cache = False  # as the target's own: every method prefills every prompt in full
                head = self.heads.get("causal")
                self._torch = (twin, jetflow.JetFlow(twin, copy.deepcopy(head).to(dtype=twin.dtype), lookup=False,
                                                     int8_draft=self.int8_draft) if head else None)
        return self._torch

    def _llama_generate(self, prompt, request: dict) -> GenerationResult:
        from jetflow.eval.llama_reference import llama_greedy, open_llama

        if not SamplingParams(request["temperature"]).greedy:
            raise JetFlowError("llama-ar is the greedy reference; use --temperature 0")
        prompt_ids, _, output = prepare_request(self.target, prompt, **request)
        if self._llama is None:
            self._llama = open_llama(self.target.gguf, n_ctx=self.target.max_context, n_threads=self.target.n_threads,
                                     flash_attn=self.target.flash_attn)
        _, seconds, _ = llama_greedy(self._llama, prompt_ids, output.max_new_tokens, output.stop_token_ids, output)
        result = GenerationResult.from_output(output, len(prompt_ids), seconds, 0.0, method="llama-ar")
        result.stats = {"rounds": max(0, result.new_tokens - 1)}
        return result

    def _native_generate(self, prompt, request: dict) -> GenerationResult:
        from jetflow.eval.llama_tools import run_speculative
        from jetflow.export.gguf import export_gguf
        from jetflow.models.checkpoint import load_drafter

        if not SamplingParams(request["temperature"]).greedy:
            raise JetFlowError("llama-dflash runs llama.cpp's driver greedily; use --temperature 0")
        if self._native_gguf is None:  # exported once per run, next to nothing the user keeps
            self._native_dir = tempfile.TemporaryDirectory(prefix="jetflow-native-")
            self._native_gguf = export_gguf(self.native_drafter, Path(self._native_dir.name) / "draft.gguf",
                                            self.target.gguf, target=self.target)
            self._native_block = load_drafter(self.native_drafter).config.block_size
        prompt_ids, _, output = prepare_request(self.target, prompt, **request)
        tokenizer = self.target.tokenizer
        run = run_speculative(self.target.gguf, self._native_gguf, tokenizer.decode(prompt_ids),
                              max_new_tokens=output.max_new_tokens, threads=self.target.n_threads,
                              n_draft=min(NATIVE_DRAFT, self._native_block - 1), n_ctx=self.target.max_context,
                              flash_attn=self.target.flash_attn)
        tokens = tokenizer.encode(run.text, add_special_tokens=False)
        if run.n_predict <= output.max_new_tokens and len(tokens) < output.max_new_tokens:
            tokens.append(run_stop_token(tokenizer, output.stop_token_ids))  # it stopped on an end-of-generation token
        output.add_many(tokens)
        result = GenerationResult.from_output(output, len(prompt_ids), run.encode_s + run.decode_s, run.encode_s,
                                              method="llama-dflash")
        result.stats = {"rounds": max(1, run.n_predict - run.n_accept)}  # each round adds its accepted tokens + 1
        return result

    @torch.inference_mode()
    def _hf_generate(self, prompt, name: str, request: dict) -> GenerationResult:
        """transformers' own ``generate`` on the same model object and prompt ids; the target
        forwards are counted with a hook so prompt lookup gets a tau too."""
        prompt_ids, params, output = prepare_request(self.target, prompt, **request)
        model = self.target.model
        forwards = [0]
        handle = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        sample = not params.greedy
        stops = sorted(output.stop_token_ids)
        # A complete config, so none of the checkpoint's generation defaults (e.g. top_k=50) leak in.
        config = GenerationConfig(do_sample=sample, max_new_tokens=output.max_new_tokens, eos_token_id=stops or None,
                                  pad_token_id=stops[0] if stops else None, top_k=params.top_k if sample else None,
                                  top_p=params.top_p if sample else None,
                                  temperature=params.temperature if sample else None,
                                  prompt_lookup_num_tokens=PLD_TOKENS if name == "pld" else None)
        ids = torch.tensor([prompt_ids], device=self.target.device)
        if sample and params.seed is not None:
            torch.manual_seed(params.seed)
        t0 = time.perf_counter()
        try:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        finally:
            handle.remove()
        seconds = time.perf_counter() - t0
        output.add_many(out[0, ids.shape[1]:].tolist())
        result = GenerationResult.from_output(output, len(prompt_ids), seconds, 0.0, method=name)
        result.stats = {"rounds": max(0, forwards[0] - 1)}
        return result


def run_stop_token(tokenizer, stop_ids: set[int]) -> int:
    """The end-of-generation token a driver that prints only text stopped on (its eos, if a stop id)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if eos in stop_ids else min(stop_ids)
