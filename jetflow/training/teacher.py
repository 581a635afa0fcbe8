"""Where the training signal comes from: the frozen target run online, or its offline cache.

Both give, for one sequence, the tapped target features of every position and the teacher's
log-probabilities over the head's (possibly reduced) vocabulary at the requested positions. With a
reduced vocabulary the teacher is restricted to it and renormalised; agreement is still scored
against the target's top-1 over its full vocabulary (:func:`top1_agreement`), which ``fetch_many``
gives too: where that top-1 lies outside the head's vocabulary, decoding's draft is rejected there.
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
        features, teacher, _ = self.fetch_many([(index, seq, positions)])
        return features[0], teacher

    def fetch_many(self, requests: list[tuple[int, Sequence, torch.Tensor]]
                   ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Features of each requested sequence, the teacher at its positions and the target's top-1
        token there over its full vocabulary [N], all rows concatenated in request order, from one
        target forward over all of them."""
        # The target in its own precision even inside the trainer's autocast (--amp): decoding reads
        # its features, and a teacher cache holds its distributions, in that precision.
        with torch.autocast(self.target.device.type, enabled=False):
            features, logits = self.target.features_and_logits_many([s.token_ids for _, s, _ in requests],
                                                                     [p for _, _, p in requests])
        top1 = logits.argmax(-1)
        if self.draft_ids is not None:
            logits = logits[:, self.draft_ids.to(logits.device)]
        # clone: inference tensors cannot enter autograd
        return [f.float().clone() for f in features], logits.log_softmax(-1), top1


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
        features, teacher, _ = self._fetch(index, seq, positions)
        return features, teacher

    def fetch_many(self, requests: list[tuple[int, Sequence, torch.Tensor]]
                   ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """:meth:`OnlineTeacher.fetch_many`'s answer, read from the cache."""
        fetched = [self._fetch(*r) for r in requests]
        return [f for f, _, _ in fetched], torch.cat([t for _, t, _ in fetched]), torch.cat([t for _, _, t in fetched])

    def _fetch(self, index: int, seq: Sequence, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features, ids, logprobs = self.cache.fetch(index)
        rows = positions.cpu() - seq.prompt_len
        if rows.numel() and (rows.min() < 0 or rows.max() >= ids.shape[0]):
            raise IndexError(f"teacher positions {positions.tolist()} are outside the cached answer span")
        teacher = dense_from_topk(ids[rows], logprobs[rows], self.draft_index, self.draft_vocab)
        top1 = ids[rows, 0].long()  # the stored top-k is over the full vocabulary, sorted
        return features.float().to(self.device), teacher.to(self.device), top1.to(self.device)


def to_target_ids(draft_ids: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """Target-vocabulary ids of a head's output ``ids`` (``draft_ids``: a reduced head's target id
    of each output row; None: a full-vocabulary head, whose ids are the target's already)."""
    return ids if draft_ids is None else draft_ids.to(ids.device)[ids]


def top1_agreement(draft_logits: torch.Tensor, draft_ids: torch.Tensor | None,
                   target_top1: torch.Tensor) -> torch.Tensor:
    """1.0 where the draft's top-1 is the target's top-1 over its full vocabulary, else 0.0 [N]:
    with a reduced vocabulary, a position whose target top-1 the head cannot propose is a miss
    (as in decoding), not a hit for the best token the head can."""
    drafted = to_target_ids(draft_ids, draft_logits.argmax(-1))
    return (drafted == target_top1.to(drafted.device)).float()
