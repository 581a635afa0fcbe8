"""Where the training signal comes from: the frozen target run online, or its offline cache.

Both give, for one sequence, the tapped target features of every position and the teacher's
log-probabilities over the head's (possibly reduced) vocabulary at the requested positions. With a
reduced vocabulary the teacher is restricted to it and renormalised.
"""

from __future__ import annotations

import torch

from jetflow.data.shards import Sequence
from jetflow.models.draft_vocab import target_to_draft_index
from jetflow.models.target import TargetModel
from jetflow.training.teacher_cache import TeacherCache


class OnlineTeacher:
    """Runs the target over each sequence when it is needed (no disk, costs a forward per use)."""

    def __init__(self, target: TargetModel, draft_ids: torch.Tensor | None):
        self.target, self.draft_ids = target, draft_ids

    def fetch(self, index: int, seq: Sequence, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features, teacher = self.fetch_many([(index, seq, positions)])
        return features[0], teacher

    def fetch_many(self, requests: list[tuple[int, Sequence, torch.Tensor]]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Features of each requested sequence and the teacher at its positions, all rows
        concatenated in request order, from one target forward over all of them."""
        # The target in its own precision even inside the trainer's autocast (--amp): decoding reads
        # its features, and a teacher cache holds its distributions, in that precision.
        with torch.autocast(self.target.device.type, enabled=False):
            features, logits = self.target.features_and_logits_many([s.token_ids for _, s, _ in requests],
                                                                     [p for _, _, p in requests])
        if self.draft_ids is not None:
            logits = logits[:, self.draft_ids.to(logits.device)]
        # clone: inference tensors cannot enter autograd
        return [f.float().clone() for f in features], logits.log_softmax(-1)


def dense_from_topk(ids: torch.Tensor, logprobs: torch.Tensor, draft_index: torch.Tensor | None,
                    draft_vocab: int) -> torch.Tensor:
    """Log-probabilities [N, Vd] from a top-k teacher [N, k]: the top-k tokens the draft vocabulary
    holds keep their probability, the mass outside the top-k is spread evenly over the remaining
    draft tokens, and the result is renormalised."""
    ids, p = ids.long(), logprobs.float().exp()
    d = ids if draft_index is None else draft_index[ids]
    kept = d >= 0
    rest = (1 - p.sum(-1, keepdim=True)).clamp(min=1e-6)
    filler = rest / (draft_vocab - kept.sum(-1, keepdim=True)).clamp(min=1)
    dense = filler.expand(ids.shape[0], draft_vocab + 1).clone()  # last column collects dropped tokens
    dense.scatter_(1, torch.where(kept, d, draft_vocab), torch.where(kept, p, 0.0))
    dense = dense[:, :draft_vocab]
    return (dense / dense.sum(-1, keepdim=True)).log()


class CachedTeacher:
    """Reads features and top-k teacher distributions from a :class:`TeacherCache`."""

    def __init__(self, cache: TeacherCache, draft_ids: torch.Tensor | None, vocab_size: int,
                 device: torch.device | str = "cpu"):
        self.cache, self.device = cache, device
        self.draft_vocab = vocab_size if draft_ids is None else draft_ids.numel()
        self.draft_index = None if draft_ids is None else target_to_draft_index(draft_ids.cpu(), vocab_size)

    def fetch(self, index: int, seq: Sequence, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features, ids, logprobs = self.cache.fetch(index)
        rows = positions.cpu() - seq.prompt_len
        if rows.numel() and (rows.min() < 0 or rows.max() >= ids.shape[0]):
            raise IndexError(f"teacher positions {positions.tolist()} are outside the cached answer span")
        teacher = dense_from_topk(ids[rows], logprobs[rows], self.draft_index, self.draft_vocab)
        return features.float().to(self.device), teacher.to(self.device)

    def fetch_many(self, requests: list[tuple[int, Sequence, torch.Tensor]]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`OnlineTeacher.fetch_many`'s answer, read from the cache."""
        fetched = [self.fetch(*r) for r in requests]
        return [f for f, _ in fetched], torch.cat([t for _, t in fetched])
