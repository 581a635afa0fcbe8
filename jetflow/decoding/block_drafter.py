"""Runs a block draft head during decoding: keeps its context cache in step with the target's
committed tokens and proposes one draft tree per round from a single head forward."""

from __future__ import annotations

import torch

from jetflow.models.backend import TargetBackend
from jetflow.models.draft_head import DraftHead, check_compatible
from jetflow.models.int8 import int8_linear, int8_linears
from jetflow.tree.build import DraftTree, build_tree


class BlockProposal:
    """One block forward's per-depth distributions; a tree of any budget is built from them."""

    def __init__(self, depth_logprobs: torch.Tensor, root: int, width: int, vocab_ids: torch.Tensor | None = None):
        """depth_logprobs [D, V'] over the target vocabulary, or over a reduced draft vocabulary
        whose target ids are ``vocab_ids`` (the top-w search then scans V' = Vd entries, not V)."""
        self.depth_logprobs, self.root, self.width, self.vocab_ids = depth_logprobs, root, width, vocab_ids

    def tree(self, budget: int) -> DraftTree:
        return build_tree(self.depth_logprobs, self.root, budget, self.width, vocab_ids=self.vocab_ids)


class BlockDrafter:
    def __init__(self, head: DraftHead, target: TargetBackend, int8: bool = False):
        check_compatible(head.config, target)
        target.set_tapped_layers(head.config.target_layer_ids)
        self.head = head.eval().requires_grad_(False)
        self.embed = target.embed  # shared, frozen
        # The head's slice of the target's LM head, taken once (all of it unless the vocabulary is reduced).
        self.lm_weight = head.output_weight(target.lm_head_weight())
        self.int8 = int8
        self.run_head, self.lm_head = self.head, None
        if int8:  # the lean CPU path: int8 weights, float activations (see jetflow/models/int8.py)
            self.run_head = int8_linears(self.head)
            self.run_head.fc = self.head.fc  # context fusion runs in extend() on the float head; forward reads its dtype
            self.lm_head = int8_linear(self.lm_weight)
        self.draft_ids = head.draft_ids
        self.vocab_size = target.vocab_size
        self.block_size = head.config.block_size
        self.reset()

    def reset(self) -> None:
        self.context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
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
        fused = self.head.fuse(features)
        self.last_feature = fused[-1]
        new = self.head.context_kv(fused, positions)
        if self.context_kv is None:
            self.context_kv = new
        else:
            self.context_kv = [(torch.cat([k, nk], -2), torch.cat([v, nv], -2))
                               for (k, v), (nk, nv) in zip(self.context_kv, new)]
        self.context_len += features.shape[0]

    def observe(self, tree: DraftTree, path: list[int]) -> None:
        pass  # a head's drafts do not depend on how earlier rounds went

    def propose(self, anchor: int, position: int, room: int, width: int, max_nodes: int | None = None) -> BlockProposal:
        """The round's draft: one head forward; ``room`` caps the depth (context end), and so does
        ``max_nodes`` (a tree of n nodes is at most n deep: a causal head skips the deeper slots)."""
        depth = room if max_nodes is None else min(room, max_nodes)
        return BlockProposal(self.head_logprobs(anchor, position, depth)[:room], anchor, width, self.draft_ids)

    def depth_logprobs(self, anchor: int, position: int, depth: int | None = None) -> torch.Tensor:
        """Draft log-probabilities [D, V] over the target vocabulary (tokens outside a reduced
        draft vocabulary get -inf); see :meth:`head_logprobs`."""
        return scatter_draft_vocab(self.head_logprobs(anchor, position, depth), self.draft_ids, self.vocab_size)

    @torch.inference_mode()
    def head_logprobs(self, anchor: int, position: int, depth: int | None = None) -> torch.Tensor:
        """Draft log-probabilities [D, Vd] of the tokens at depths 1..D after ``anchor``, over the
        head's own vocabulary (its ids are ``draft_ids``; all of the target's when None). D is B-1, or ``depth``
        when smaller and the head is causal: its slot j never sees later slots, so running the first
        depth+1 slots gives exactly their outputs in the full block."""
        self._project_pending()
        if position != self.context_len:
            raise RuntimeError(f"draft context holds {self.context_len} tokens but the anchor is at {position}")
        b = self.block_size
        if depth is not None and self.head.config.attention == "causal":
            b = max(2, min(b, depth + 1))
        device = self.head.fc.weight.device
        ids = torch.full((b,), self.head.config.mask_token_id, dtype=torch.long, device=device)
        ids[0] = anchor
        positions = torch.arange(position, position + b, device=device)
        mask = self.head.block_mask(self.context_len, device)[:b, : self.context_len + b]
        hidden = self.run_head(self.embed(ids), positions, self.context_kv, mask, self.last_feature)
        if self.lm_head is not None:
            return self.lm_head(hidden[1:]).float().log_softmax(-1)
        return draft_logprobs(hidden[1:], self.lm_weight)


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


def draft_logprobs(hidden: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [N, Vd] over the head's own (possibly reduced) vocabulary."""
    return (hidden.to(lm_weight.dtype) @ lm_weight.T).float().log_softmax(-1)
