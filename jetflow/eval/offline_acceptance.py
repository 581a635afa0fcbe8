"""Acceptance of a block draft head measured offline, on sequences the target generated greedily.

On such a sequence, greedy speculative decoding from an anchor accepts exactly the longest prefix of
the sequence's own continuation that lies in the round's draft tree: at every node the target's
argmax *is* the next data token. So decoding can be replayed without the target: head forwards over
the sequence's anchors (batched, as in training), one best-first tree per round, the next round
right after the bonus token. That reproduces decoding's rounds and tau exactly (tested round by round
against the decoding loop, tests/test_offline_acceptance.py) at a fraction of the cost, which is
what ablations between heads need. Uniform random anchors are an option; they weight every position
alike, while decoding spends more rounds where drafts fail, so their tau reads higher.

Only block heads: an autoregressive (eagle3) head drafts each depth from its own path, so its tree
needs the decoding loop (``jetflow bench``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from jetflow.data.shards import Sequence
from jetflow.decoding.block_drafter import to_target_logprobs
from jetflow.errors import JetFlowError
from jetflow.models.draft_head import DraftHead
from jetflow.models.target import TargetModel
from jetflow.training.blocks import make_blocks, sample_anchors
from jetflow.training.trainer import blocks_forward
from jetflow.tree.build import DraftTree, build_tree


def path_nodes(tree: DraftTree, continuation: list[int]) -> list[int]:
    """Nodes of the longest prefix of ``continuation`` that the tree holds, shallowest first (node
    numbers are best-first order, so they increase along the path)."""
    nodes, node = [], 0
    for token in continuation:
        node = tree.children[node].get(token)
        if node is None:
            break
        nodes.append(node)
    return nodes


def accepted_depth(nodes: list[int], budget: int) -> int:
    """Draft tokens accepted by the tree of ``budget`` nodes, the prefix of the best-first order."""
    return sum(1 for n in nodes if n <= budget)


CHAIN = "chain"  # width-1 chain of the whole block (the DFlash draft), measured next to the trees


@dataclass
class OfflineAcceptance:
    budgets: list[int]
    width: int
    mode: str  # "decode": rounds where decoding puts them; "uniform": random anchors
    depths: dict = field(default_factory=dict)  # budget or CHAIN -> accepted draft tokens of each round
    depth_reached: list[int] = field(default_factory=list)  # [d]: rounds of the largest budget accepting >= d+1

    @property
    def rounds(self) -> dict:
        return {arm: len(d) for arm, d in self.depths.items()}

    @property
    def accepted(self) -> dict:
        return {arm: sum(d) for arm, d in self.depths.items()}

    def add(self, arm, depth: int) -> None:
        self.depths.setdefault(arm, []).append(depth)
        if arm == max(self.budgets):
            self.depth_reached += [0] * (depth - len(self.depth_reached))
            for d in range(depth):
                self.depth_reached[d] += 1

    def tau(self, arm) -> float:
        return 1 + self.accepted.get(arm, 0) / max(1, self.rounds.get(arm, 0))

    def summary(self) -> dict:
        """tau counts the bonus token (1 + accepted draft tokens per round), as ``jetflow bench`` does."""
        largest = self.rounds.get(max(self.budgets), 0)
        return {"mode": self.mode, "width": self.width,
                "rounds": {str(b): self.rounds.get(b, 0) for b in [*self.budgets, CHAIN]},
                "tau": {str(b): self.tau(b) for b in self.budgets},
                "chain_tau": self.tau(CHAIN),
                "depth_acceptance": [c / max(1, largest) for c in self.depth_reached]}


class _Drafts:
    """Per-anchor draft log-probabilities of one sequence: head forwards over chunks of anchors,
    computed when a walk first needs them."""

    def __init__(self, head, embed, lm_weight, vocab_size, features, tokens, chunk: int = 64):
        self.head, self.embed, self.lm_weight, self.vocab_size = head, embed, lm_weight, vocab_size
        self.features, self.tokens, self.chunk = features, tokens, chunk
        self.cache: dict[int, torch.Tensor] = {}

    def __call__(self, anchor: int, upcoming: list[int]) -> torch.Tensor:
        if anchor not in self.cache:
            picks = torch.tensor(sorted({anchor, *[a for a in upcoming if a not in self.cache]})[:self.chunk])
            block = self.head.config.block_size
            blocks = make_blocks(self.tokens, picks, block, self.head.config.mask_token_id)
            hidden = blocks_forward(self.head, self.embed, self.features, blocks).view(len(picks), block, -1)
            for k, a in enumerate(picks.tolist()):
                self.cache[a] = to_target_logprobs(hidden[k, 1:], self.lm_weight, self.head.draft_ids,
                                                   self.vocab_size)
        return self.cache[anchor]


@torch.no_grad()
def offline_acceptance(head: DraftHead, target: TargetModel, sequences: list[Sequence], teacher, indices: list[int],
                       budgets: list[int], width: int = 7, anchors_per_seq: int = 0, seed: int = 0,
                       anchors: dict[int, torch.Tensor] | None = None) -> OfflineAcceptance:
    """Greedy acceptance of ``head`` over ``sequences[i]`` for i in ``indices``.

    ``teacher`` gives each sequence's tapped target features (an ``OnlineTeacher`` or ``CachedTeacher``).
    Rounds are placed where greedy decoding places them (``anchors_per_seq=0``, the default): the
    first at the answer's first token, each next one right after the previous round's bonus token,
    separately per budget -- this reproduces decoding's tau. Otherwise each sequence gets
    ``anchors_per_seq`` random answer anchors (seeded), or the given ``anchors[i]``, shared by all
    budgets. A round near the end accepts at most the tokens left in the sequence."""
    if head.config.kind != "block":
        raise JetFlowError(f"offline acceptance needs a block head; this one is {head.config.kind!r} "
                           "(measure it with `jetflow bench`)")
    if not budgets or min(budgets) < 1:
        raise JetFlowError(f"budgets must be >= 1, got {budgets}")
    head = head.eval()
    embed = target.model.get_input_embeddings()
    lm_weight = head.output_weight(target.model.get_output_embeddings().weight)
    block, budgets = head.config.block_size, sorted(budgets)
    arms = [(b, b, width) for b in budgets] + [(CHAIN, block - 1, 1)]
    walk = anchors is None and anchors_per_seq == 0
    result = OfflineAcceptance(budgets, width, "decode" if walk else "uniform")
    g = torch.Generator().manual_seed(seed)
    for index in indices:
        seq = sequences[index]
        last = len(seq.token_ids) - 2  # the last anchor with a token after it
        if last < seq.prompt_len:
            continue
        features, _ = teacher.fetch(index, seq, torch.zeros(0, dtype=torch.long))
        drafts = _Drafts(head, embed, lm_weight, target.vocab_size, features, torch.tensor(seq.token_ids))

        def accepted(a: int, size: int, w: int, upcoming: list[int]) -> int:
            continuation = seq.token_ids[a + 1:a + block]
            depth_lp = drafts(a, upcoming)[:len(continuation)]
            return accepted_depth(path_nodes(build_tree(depth_lp, seq.token_ids[a], size, w), continuation), size)

        if walk:
            for arm, size, w in arms:
                a = seq.prompt_len
                while a <= last:
                    depth = accepted(a, size, w, list(range(a + 1, last + 1)))
                    result.add(arm, depth)
                    a += depth + 1
        else:
            picks = anchors[index] if anchors is not None else sample_anchors(seq.prompt_len, len(seq.token_ids),
                                                                             anchors_per_seq, g)
            for a in picks.tolist():
                for arm, size, w in arms:
                    result.add(arm, accepted(a, size, w, picks.tolist()))
    return result


def parse_range(text: str | None, total: int) -> tuple[int, int]:
    """``START:END`` (either side may be empty) over ``total`` sequences; None means all."""
    if not text:
        return 0, total
    try:
        start_text, end_text = text.split(":")
        start = int(start_text) if start_text else 0
        end = int(end_text) if end_text else total
    except ValueError:
        raise JetFlowError(f"sequence range must look like START:END, e.g. 1536:1771, got {text!r}") from None
    if not 0 <= start < end <= total:
        raise JetFlowError(f"sequence range {text!r} is empty or outside the {total} sequences of the data")
    return start, end


def evaluate_drafters(target: TargetModel, drafters: list[str], data_dir, teacher_cache=None, seq_range=None,
                      budgets=(16, 32, 64, 128, 256), width: int = 7, anchors_per_seq: int = 0,
                      seed: int = 0, log=print) -> dict:
    """Offline acceptance of each drafter checkpoint on a range of regenerated sequences (rounds where
    decoding puts them, or the same random anchors for every drafter). Features come from
    ``teacher_cache`` or from the target run online."""
    from jetflow.training.teacher import CachedTeacher, OnlineTeacher
    from jetflow.training.teacher_cache import TeacherCache
    from jetflow.training.trainer import load_sequences

    sequences = load_sequences(data_dir, target)
    start, end = parse_range(seq_range, len(sequences))
    heads = {path: DraftHead.from_pretrained(path, target=target, device=target.device, dtype=torch.float32)
             for path in drafters}
    results = {}
    for path, head in heads.items():
        target.set_tapped_layers(head.config.target_layer_ids)
        if teacher_cache is None:
            teacher = OnlineTeacher(target, None)
        else:  # the cache checks its parts against the data, so hand it whole parts up to the range's end
            m = TeacherCache.read_manifest(teacher_cache)
            per, cached = m["sequences_per_part"], m.get("num_sequences", len(sequences))
            covered = sequences[:max(end, min(len(sequences), cached, -(-end // per) * per))]
            teacher = CachedTeacher(TeacherCache(teacher_cache, covered, target, head.config.target_layer_ids),
                                    None, target.vocab_size, target.device)
        t0 = time.perf_counter()
        result = offline_acceptance(head, target, sequences, teacher, list(range(start, end)), list(budgets),
                                    width, anchors_per_seq, seed)
        results[str(path)] = {**result.summary(), "seconds": round(time.perf_counter() - t0, 1)}
        log(f"{path}: chain tau {results[str(path)]['chain_tau']:.2f}, tree tau "
            + ", ".join(f"{b}: {t:.2f}" for b, t in results[str(path)]["tau"].items()))
    return {"data": str(data_dir), "teacher_cache": None if teacher_cache is None else str(teacher_cache),
            "sequences": [start, end], "anchors_per_seq": anchors_per_seq, "seed": seed, "width": width,
            "budgets": list(budgets), "drafters": results}
