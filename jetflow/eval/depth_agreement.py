"""Per-depth top-1 agreement of a draft head with the target, at every answer position.

For a head of either kind (block or EAGLE-3-style) and every anchor a of a held-out regenerated
sequence (every answer position with a token after it), the draft's top-1 token at depth k (the token
at position a+k) is compared with the target's top-1 token there (its argmax at position a+k-1,
from the teacher cache or the target run online). Depth 1 is the same prediction for both kinds:
target features up to a-1 plus the anchor token.

* block head: blocks [anchor, MASK x D] at every anchor, in chunks, through the training forward
  (tested equal to the decoder drafting from each anchor); a causal head's block is cut after D+1
  slots (slot k sees only slots <= k), a bidirectional one runs whole blocks.
* EAGLE head: its training-time-test unroll over every anchor (``ttt_states``): depth k is step k-1
  of the chain, given the sequence's own tokens a+1..a+k-1 (the draft path that a greedy round
  accepts up to there).

With ``path_conditioned``, a causal block head's depth-k draft comes from a block whose slots 1..k-1
hold the sequence's own tokens (revealed blocks, the layout of its path-conditioned second pass,
decoding/refine.py), so both kinds are scored given the true path.

Besides agreement at each depth (the fraction of anchors with a+k inside the sequence whose depth-k
draft is the target's token), ``prefix_agreement[k-1]`` is the fraction whose depths 1..k all agree:
the probability that a greedy chain from a uniformly drawn anchor accepts at least k tokens, which
is what the two kinds can be compared on (a block head's deep slots do not see the tokens before
them; an EAGLE head's steps do).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from jetflow.data.shards import Sequence
from jetflow.errors import JetFlowError
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead
from jetflow.models.target import TargetModel
from jetflow.training.block_objective import block_context, blocks_forward
from jetflow.training.blocks import answer_anchors, make_blocks
from jetflow.training.teacher import to_target_ids


@dataclass
class DepthAgreement:
    max_depth: int
    hits: list[int] = field(default_factory=list)  # [D] depth-k drafts equal to the target's top-1
    counts: list[int] = field(default_factory=list)  # [D] anchors with a token at depth k
    prefix_hits: list[int] = field(default_factory=list)  # [D] anchors whose depths 1..k all agree
    sequences: int = 0

    def __post_init__(self):
        for name in ("hits", "counts", "prefix_hits"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.max_depth)

    def add(self, agree: torch.Tensor, valid: torch.Tensor) -> None:
        """``agree``, ``valid``: bool [anchors, D] (valid: the depth-k token exists)."""
        prefix = (agree | ~valid).long().cumprod(-1).bool() & valid
        for k in range(self.max_depth):
            self.hits[k] += int((agree[:, k] & valid[:, k]).sum())
            self.counts[k] += int(valid[:, k].sum())
            self.prefix_hits[k] += int(prefix[:, k].sum())
        self.sequences += 1

    def summary(self) -> dict:
        return {"max_depth": self.max_depth, "sequences": self.sequences, "anchors": self.counts[0],
                "agreement": [h / max(1, c) for h, c in zip(self.hits, self.counts)],
                "prefix_agreement": [h / max(1, c) for h, c in zip(self.prefix_hits, self.counts)],
                "counts": list(self.counts)}


def _to_target_ids(head: DraftHead, draft_ids: torch.Tensor) -> torch.Tensor:
    return to_target_ids(head.draft_ids, draft_ids)  # the mapping the trainer's agreement uses too


def depth_hidden(head: DraftHead, embed, features: torch.Tensor, context, tokens: torch.Tensor, anchors: torch.Tensor,
                 k: int, revealed: bool) -> torch.Tensor:
    """Head states [anchors, H] of depth k from each anchor: slot k of a causal (k+1)-slot block whose
    slots 1..k-1 hold MASK, or with ``revealed`` the sequence's own next tokens (the path given)."""
    shown = torch.full((len(anchors),), k - 1 if revealed else 0, dtype=torch.long)
    blocks = make_blocks(tokens, anchors, k + 1, head.config.mask_token_id, shown)
    return blocks_forward(head, embed, features, blocks, context).view(len(anchors), k + 1, -1)[:, k]


@torch.no_grad()
def block_depth_predictions(head: DraftHead, embed, lm_weight: torch.Tensor, features: torch.Tensor,
                            tokens: torch.Tensor, prompt_len: int, max_depth: int, chunk: int = 64,
                            path_conditioned: bool = False) -> torch.Tensor:
    """Top-1 target token ids [anchors, max_depth] of a block head at every answer anchor (with
    ``path_conditioned``, depth k after the true tokens of depths 1..k-1: one block layout per depth)."""
    if max_depth > head.config.block_size - 1:
        raise JetFlowError(f"max depth {max_depth} is beyond the block head's {head.config.block_size - 1} depths")
    if path_conditioned and head.config.attention != "causal":
        raise JetFlowError("path-conditioned agreement needs a causal block head")
    anchors = answer_anchors(prompt_len, len(tokens))
    size = max_depth + 1 if head.config.attention == "causal" else head.config.block_size
    context = block_context(head, features)
    out = []
    for start in range(0, len(anchors), chunk):
        picks = anchors[start:start + chunk]
        if path_conditioned:  # depth k: slots 1..k-1 revealed, read slot k of a (k+1)-slot block
            top = torch.stack([(depth_hidden(head, embed, features, context, tokens, picks, k, True)
                                .to(lm_weight.dtype) @ lm_weight.T).argmax(-1) for k in range(1, max_depth + 1)], 1)
        else:
            blocks = make_blocks(tokens, picks, size, head.config.mask_token_id)
            hidden = blocks_forward(head, embed, features, blocks, context).view(len(picks), size, -1)
            slots = hidden[:, 1:max_depth + 1].reshape(-1, hidden.shape[-1]).to(lm_weight.dtype)  # 2-D: a strided
            top = (slots @ lm_weight.T).argmax(-1).view(len(picks), max_depth)  # 3-D matmul is ~6x slower here
        out.append(_to_target_ids(head, top).cpu())
    return torch.cat(out) if out else torch.zeros(0, max_depth, dtype=torch.long)


@torch.no_grad()
def eagle_depth_predictions(head, embed, lm_weight: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor,
                            prompt_len: int, max_depth: int) -> torch.Tensor:
    """Top-1 target token ids [anchors, max_depth] of an EAGLE head at every answer anchor (depth k:
    unroll step k-1 of the anchor's chain; -1 where the chain runs past the sequence)."""
    from jetflow.training.eagle_objective import ttt_states

    if max_depth > head.max_depth:
        raise JetFlowError(f"max depth {max_depth} is beyond the EAGLE head's {head.max_depth} levels")
    device = features.device
    anchors = answer_anchors(prompt_len, len(tokens))
    preds = torch.full((len(anchors), max_depth), -1, dtype=torch.long)
    if not len(anchors):
        return preds
    states = ttt_states(head, embed(tokens.to(device)), features, max_depth, anchors)
    for step, s in enumerate(states):
        rows = s[anchors.to(device)] if step == 0 else s
        ids = _to_target_ids(head, head.logits(rows, lm_weight).argmax(-1)).cpu()
        preds[:len(ids), step] = ids
    return preds


def depth_agreement_of_sequence(head: DraftHead, embed, lm_weight, features: torch.Tensor, seq: Sequence,
                                teacher_top1: torch.Tensor, max_depth: int,
                                path_conditioned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(agree, valid) bool [anchors, max_depth] of one sequence; ``teacher_top1`` [L-1-prompt_len]:
    the target's top-1 token at positions prompt_len..L-2 (the token it would put at the next one)."""
    tokens = torch.tensor(seq.token_ids)
    if head.config.kind == "eagle3":  # its depth k is conditioned on the true path already
        preds = eagle_depth_predictions(head, embed, lm_weight, features, tokens, seq.prompt_len, max_depth)
    else:
        preds = block_depth_predictions(head, embed, lm_weight, features, tokens, seq.prompt_len, max_depth,
                                        path_conditioned=path_conditioned)
    anchors = answer_anchors(seq.prompt_len, len(tokens))
    k = torch.arange(1, max_depth + 1)
    rows = anchors[:, None] + k[None, :] - 1 - seq.prompt_len  # teacher row of position a+k-1
    valid = anchors[:, None] + k[None, :] <= len(tokens) - 1
    truth = teacher_top1[rows.clamp(max=len(teacher_top1) - 1)]
    return (preds == truth) & valid, valid


def teacher_top1(teacher, index: int, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """Tapped features of the sequence and the target's top-1 token at positions prompt_len..L-2,
    from a ``CachedTeacher`` (its stored top-k, sorted) or any teacher over the full vocabulary."""
    from jetflow.training.teacher import CachedTeacher

    positions = torch.arange(seq.prompt_len, len(seq.token_ids) - 1)
    if isinstance(teacher, CachedTeacher):
        features, ids, _ = teacher.cache.fetch(index)
        return features.float().to(teacher.device), ids[:, 0].long()
    features, logprobs = teacher.fetch(index, seq, positions)
    return features, logprobs.argmax(-1).cpu()


@torch.no_grad()
def depth_agreement(head: DraftHead, target: TargetModel, sequences: list[Sequence], teacher, indices: list[int],
                    max_depth: int = 4, path_conditioned: bool = False) -> DepthAgreement:
    """Per-depth agreement of ``head`` over ``sequences[i]`` for i in ``indices``, at every answer anchor.
    ``teacher`` must give the full vocabulary (an ``OnlineTeacher``/``CachedTeacher`` built without draft ids)."""
    if max_depth < 1:
        raise JetFlowError(f"max depth must be >= 1, got {max_depth}")
    head = head.eval()
    lm_weight = head.output_weight(target.lm_head_weight())
    result = DepthAgreement(max_depth)
    for index in indices:
        seq = sequences[index]
        if len(seq.token_ids) - 2 < seq.prompt_len:
            continue
        features, top1 = teacher_top1(teacher, index, seq)
        agree, valid = depth_agreement_of_sequence(head, target.embed, lm_weight, features, seq, top1, max_depth,
                                                   path_conditioned)
        result.add(agree, valid)
    return result


def evaluate_agreement(target: TargetModel, drafters: list[str], data_dir, teacher_cache=None, seq_range=None,
                       max_depth: int = 4, log=print, path_conditioned: bool = False) -> dict:
    """Per-depth agreement of each drafter checkpoint (block or EAGLE) on a range of regenerated
    sequences; features and the target's top-1 from ``teacher_cache`` or the target run online."""
    from jetflow.eval.offline_acceptance import eval_teacher, parse_range
    from jetflow.training.trainer import data_label, load_sequences

    sequences = load_sequences(data_dir, target)
    start, end = parse_range(seq_range, len(sequences))
    results = {}
    for path in drafters:
        head = load_drafter(path, target=target, device=target.device, dtype=torch.float32)
        target.set_tapped_layers(head.config.target_layer_ids)
        teacher = eval_teacher(target, sequences, end, teacher_cache, head.config.target_layer_ids)
        t0 = time.perf_counter()
        summary = depth_agreement(head, target, sequences, teacher, list(range(start, end)), max_depth,
                                  path_conditioned).summary()
        results[str(path)] = {"kind": head.config.kind, **summary, "seconds": round(time.perf_counter() - t0, 1)}
        log(f"{path} ({head.config.kind}): agreement " + " ".join(f"{a:.3f}" for a in summary["agreement"])
            + " | prefix " + " ".join(f"{a:.3f}" for a in summary["prefix_agreement"]))
    return {"data": data_label(data_dir), "teacher_cache": None if teacher_cache is None else str(teacher_cache),
            "sequences": [start, end], "max_depth": max_depth, "path_conditioned": path_conditioned,
            "drafters": results}
