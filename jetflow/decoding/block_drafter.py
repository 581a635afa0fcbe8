"""Runs a block draft head during decoding: keeps its context cache in step with the target's
committed tokens and proposes one draft tree per round from a single head forward."""

from __future__ import annotations

import copy

import torch

from jetflow.decoding.refine import refined_proposal, tree_passes, tree_refined_proposal
from jetflow.models.backend import TargetBackend
from jetflow.models.draft_head import DraftHead, check_compatible
from jetflow.models.few_row_linear import few_row_linear, use_few_row_linear
from jetflow.models.int8 import int8_linear, int8_linears
from jetflow.tree.build import DraftTree, build_tree
from jetflow.tree.calibration import TreeCalibration


INT8_CONTEXT_ROWS = 64  # committed rows at most that an int8 drafter projects with its int8 linears
INT8_MAX_SCALED_FEATURE = 32.0  # ... if no scaled feature exceeds this (SmolLM2's rows: median max ~4, up to ~15)


class BlockProposal:
    """One block forward's per-depth distributions; a tree of any budget is built from them."""

    def __init__(self, depth_logprobs: torch.Tensor, root: int, width: int, vocab_ids: torch.Tensor | None = None,
                 calibration: TreeCalibration | None = None):
        """depth_logprobs [D, V'] over the target vocabulary, or over a reduced draft vocabulary
        whose target ids are ``vocab_ids`` (the top-w search then scans V' = Vd entries, not V).
        ``calibration``: the head's tree calibration (node scores are then acceptance log-probs)."""
        self.depth_logprobs, self.root, self.width, self.vocab_ids = depth_logprobs, root, width, vocab_ids
        self.calibration = calibration

    def tree(self, budget: int) -> DraftTree:
        return build_tree(self.depth_logprobs, self.root, budget, self.width, vocab_ids=self.vocab_ids,
                          calibration=self.calibration)


class BlockDrafter:
    def __init__(self, head: DraftHead, target: TargetBackend, int8: bool = False,
                 refine: bool | int | str | None = None):
        """``refine``: run the path-conditioned second pass each round (decoding/refine.py); an int N:
        N such passes, each on the path the one before chose; "tree": one pass conditioning every node
        of the first pass's tree (heads that shift tokens), "tree:N" N of them; None: one when the
        head was trained for it (``config.path_refine``). Trees use the head's tree calibration
        when its checkpoint has one (not with the second pass, whose rows it was not fitted on)."""
        check_compatible(head.config, target)
        self.refine_tree = tree_passes(refine)  # 0: path passes (or none)
        if self.refine_tree and not head.config.shift_tokens:
            raise ValueError("the tree-conditioned pass needs a head that shifts tokens (--shift-tokens)")
        self.refine = 1 if self.refine_tree else int(head.config.path_refine if refine is None else refine)
        if self.refine < 0:
            raise ValueError(f"refine passes must be >= 0, got {refine}")
        if self.refine and head.config.attention != "causal":
            raise ValueError("the path-conditioned pass needs a causal block head")
        target.set_tapped_layers(head.config.target_layer_ids)
        self.head = head.eval().requires_grad_(False)
        self.embed = target.embed  # shared, frozen
        # The head's slice of the target's LM head, taken once (all of it unless the vocabulary is reduced).
        self.lm_weight = head.output_weight(target.lm_head_weight())
        self.int8 = int8
        # Where the target's few-row products run as W @ x^T (this CPU's BLAS is faster so), so do the head's.
        self.few_rows = not int8 and getattr(target, "linear_form", "standard") != "standard"
        if self.few_rows:
            use_few_row_linear(self.head, form="transposed")
        self.run_head, self.lm_head = self.head, None
        if int8:  # the lean CPU path: int8 weights, float activations (see jetflow/models/int8.py)
            self.run_head = int8_linears(self.head)
            self.lm_head = int8_linear(self.lm_weight)
        self.draft_ids = head.draft_ids
        self.calibration = None if self.refine else head.config.calibration
        self.vocab_size = target.vocab_size
        self.block_size = head.config.block_size
        self.reset()

    def fork(self, target: TargetBackend) -> "BlockDrafter":
        """A drafter for another sequence of the same target (a request of a batch): the same
        read-only weights (float and int8, prepared once), an empty context."""
        twin = copy.copy(self)
        twin.reset()
        return twin

    def reset(self) -> None:
        # Every layer's context keys/values: views of buffers with room to grow (``_kv_room``), so
        # a round's few new rows are written in place instead of copying the whole context.
        self.context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._kv_room: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.last_feature: torch.Tensor | None = None  # fused feature of the last committed token
        self.context_len = 0
        self._pending: list[torch.Tensor] = []  # features of committed tokens not yet projected

    def extend(self, features: torch.Tensor) -> None:
        """Append the tapped target features [n, taps*H] of newly committed tokens to the context.
        They are projected when the next draft needs them, all at once: rounds that decode plainly
        (``--budget auto`` when drafting does not pay) then cost the head nothing."""
        if features.shape[0]:
            self._pending.append(features)

    @torch.inference_mode()
    def _project_pending(self) -> None:
        """Project the features queued by :meth:`extend`; earlier context keys/values are reused."""
        if not self._pending:
            return
        features = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)
        self._pending = []
        positions = torch.arange(self.context_len, self.context_len + features.shape[0], device=features.device)
        # A round's few committed rows go through the int8 linears (the float fusion read 6.6 MB of
        # weights for them, 0.9 ms on a 2-core CPU); a prompt's rows stay float: int8 quantizes a
        # call's activations with one scale, which the first position's row (an attention sink,
        # ~100x the rest) would set, and many rows make the weights' bytes cheap per row anyway.
        few = 0 < self.context_len and features.shape[0] <= INT8_CONTEXT_ROWS and self.run_head is not self.head
        # ... nor a row with a value far above the scaled features' usual few units (a token that
        # carries massive activations mid-sequence), which would coarsen the rest the same way.
        if few and (features / self.head.feature_scale.to(features.dtype)).abs().amax() > INT8_MAX_SCALED_FEATURE:
            few = False
        head = self.run_head if few else self.head
        fused = head.fuse(features)
        self.last_feature = fused[-1].to(self.head.dtype)
        self._append_context_kv(head.context_kv(fused, positions))

    def _append_context_kv(self, new: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        start = self.context_len
        end = start + new[0][0].shape[-2]
        room = 0 if self._kv_room is None else self._kv_room[0][0].shape[-2]
        if end > room:  # grow geometrically (rounds after a long prompt too): appends cost their own rows, amortized
            size = max(end + 256, 2 * room)
            grown = []
            for layer, (nk, nv) in enumerate(new):  # in the float head's dtype, whichever head projected
                k, v = (t.new_empty(*t.shape[:-2], size, t.shape[-1], dtype=self.head.dtype) for t in (nk, nv))
                if start:
                    k[..., :start, :], v[..., :start, :] = self.context_kv[layer]
                grown.append((k, v))
            self._kv_room = grown
        for (k, v), (nk, nv) in zip(self._kv_room, new):
            k[..., start:end, :], v[..., start:end, :] = nk, nv
        self.context_kv = [(k[..., :end, :], v[..., :end, :]) for k, v in self._kv_room]
        self.context_len = end

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        pass  # a head's drafts do not depend on how earlier rounds went

    def propose(self, anchor: int, position: int, room: int, width: int, max_nodes: int | None = None) -> BlockProposal:
        """The round's draft: one head forward; ``room`` caps the depth (context end), and so does
        ``max_nodes`` (a tree of n nodes is at most n deep: a causal head skips the deeper slots)."""
        depth = room if max_nodes is None else min(room, max_nodes)
        first = self.head_logprobs(anchor, position, depth)[:room]
        if self.refine_tree and max_nodes:
            return tree_refined_proposal(self, anchor, position, first, width, max_nodes, self.refine_tree)
        if self.refine and first.shape[0] >= 2:
            return refined_proposal(self, anchor, position, first, width, self.refine)
        return self.proposal(first, anchor, width)

    def proposal(self, depth_logprobs: torch.Tensor, anchor: int, width: int) -> BlockProposal:
        """The proposal of a round from this head's log-probabilities [D, Vd] (however they were computed)."""
        return BlockProposal(depth_logprobs, anchor, width, self.draft_ids, self.calibration)

    def depth_logprobs(self, anchor: int, position: int, depth: int | None = None) -> torch.Tensor:
        """Draft log-probabilities [D, V] over the target vocabulary (tokens outside a reduced
        draft vocabulary get -inf); see :meth:`head_logprobs`."""
        return scatter_draft_vocab(self.head_logprobs(anchor, position, depth), self.draft_ids, self.vocab_size)

    def slots(self, depth: int | None) -> int:
        """Block slots a draft of ``depth`` levels runs (a causal head skips the deeper ones)."""
        b = self.block_size
        if depth is not None and self.head.config.attention == "causal":
            b = max(2, min(b, depth + 1))
        return b

    def _output_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float().log_softmax(-1)
        return draft_logprobs(hidden, self.lm_weight, self.few_rows)

    @torch.inference_mode()
    def head_logprobs(self, anchor: int, position: int, depth: int | None = None) -> torch.Tensor:
        """Draft log-probabilities [D, Vd] of the tokens at depths 1..D after ``anchor``, over the
        head's own vocabulary (its ids are ``draft_ids``; all of the target's when None). D is B-1, or ``depth``
        when smaller and the head is causal: its slot j never sees later slots, so running the first
        depth+1 slots gives exactly their outputs in the full block."""
        self._project_pending()
        if position != self.context_len:
            raise RuntimeError(f"draft context holds {self.context_len} tokens but the anchor is at {position}")
        b = self.slots(depth)
        device = self.head.fc.weight.device
        ids = torch.full((b,), self.head.config.mask_token_id, dtype=torch.long, device=device)
        ids[0] = anchor
        positions = torch.arange(position, position + b, device=device)
        mask = self.head.block_mask(self.context_len, device)[:b, : self.context_len + b]
        hidden = self.run_head(self.embed(ids), positions, self.context_kv, mask, self.last_feature)
        return self._output_logprobs(hidden[1:])


@torch.inference_mode()
def head_logprobs_many(drafters: list[BlockDrafter], anchors: list[int], positions: list[int],
                       depths: list[int | None]) -> list[torch.Tensor]:
    """:meth:`BlockDrafter.head_logprobs` of several drafters of one head (one per request, each
    with its own context) in ONE head forward: every block as long as the longest needed (a causal
    head's slot j never sees later slots, so each request then reads its first slots). Equal to the
    one-by-one results up to float rounding."""
    first = drafters[0]
    slots = [d.slots(depth) for d, depth in zip(drafters, depths)]
    b = max(slots)
    ids = torch.full((len(drafters), b), first.head.config.mask_token_id, dtype=torch.long)
    ids[:, 0] = torch.as_tensor(anchors, dtype=torch.long)
    inner = first.head.block_mask(0)[:b, :b]
    hidden = run_head_many(drafters, ids, positions, inner)
    out = first._output_logprobs(hidden[:, 1:])
    return [out[i, :n - 1] for i, n in enumerate(slots)]


def run_head_many(drafters: list[BlockDrafter], ids: torch.Tensor, positions: list[int], inner: torch.Tensor,
                  depths: torch.Tensor | None = None) -> torch.Tensor:
    """Head states [R, S, H] of R drafters of one head in ONE forward: request i's S slots read
    ``ids[i]`` from its anchor at ``positions[i]`` (each drafter's context must end right there) and see
    its own context (padded to the longest and masked) and the slots ``inner`` [S, S] allows;
    ``depths`` [S]: the slots form one tree (see DraftHead.forward), else one block."""
    first = drafters[0]
    device = first.head.fc.weight.device
    for d, position in zip(drafters, positions):
        d._project_pending()
        if position != d.context_len:
            raise RuntimeError(f"draft context holds {d.context_len} tokens but the anchor is at {position}")
    r, s = ids.shape
    c = max(d.context_len for d in drafters)
    offsets = torch.arange(s, device=device) if depths is None else depths.to(device)
    pos = torch.as_tensor(positions, device=device)[:, None] + offsets
    lengths = torch.as_tensor([d.context_len for d in drafters], device=device)
    mask = torch.cat([(torch.arange(c, device=device) < lengths[:, None])[:, None, :].expand(r, s, c),
                      inner.to(device).expand(r, s, s)], dim=-1)
    context_kv = []
    for layer in range(len(first.context_kv)):
        k0, v0 = first.context_kv[layer]
        k = k0.new_zeros(r, k0.shape[0], c, k0.shape[-1])
        v = v0.new_zeros(r, v0.shape[0], c, v0.shape[-1])
        for i, d in enumerate(drafters):
            dk, dv = d.context_kv[layer]
            k[i, :, :d.context_len], v[i, :, :d.context_len] = dk, dv
        context_kv.append((k, v))
    last = torch.stack([d.last_feature for d in drafters])[:, None, :]
    return first.run_head(first.embed(ids.to(device)), pos, context_kv, mask, last,
                          **({} if depths is None else {"depths": depths.to(device)}))


def to_target_logprobs(hidden: torch.Tensor, lm_weight: torch.Tensor, draft_ids: torch.Tensor | None,
                       vocab_size: int) -> torch.Tensor:
    """Log-probabilities [N, V] over the target vocabulary from head states [N, H] (tokens outside a
    reduced draft vocabulary get -inf)."""
    return scatter_draft_vocab(draft_logprobs(hidden, lm_weight), draft_ids, vocab_size)


def scatter_draft_vocab(logprobs: torch.Tensor, draft_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[N, Vd] log-probabilities over the draft vocabulary -> [N, V] over the target's (-inf outside)."""
    if draft_ids is None:
        return logprobs
    full = logprobs.new_full((logprobs.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, draft_ids, logprobs)


def draft_logprobs(hidden: torch.Tensor, lm_weight: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """Log-probabilities [N, Vd] over the head's own (possibly reduced) vocabulary; ``transposed``:
    few rows computed as W @ h^T (models/few_row_linear.py)."""
    return few_row_linear(hidden.to(lm_weight.dtype), lm_weight, transposed).float().log_softmax(-1)
