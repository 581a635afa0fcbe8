"""Acceptance of a block draft head measured offline, on sequences the target generated greedily.

On such a sequence, greedy speculative decoding from an anchor accepts exactly the longest prefix of
the sequence's own continuation that lies in the round's draft tree: at every node the target's
argmax *is* the next data token. So tau at every budget follows from one head forward per sequence
(all its anchors at once, as in training) and one best-first tree per anchor, with no target forward
and no decoding loop: thousands of anchors in minutes, which is what ablations between heads need.
A best-first tree of budget n is the first n+1 nodes of the largest one, so one tree prices every
budget. Tested against the real decoding loop, round by round (tests/test_offline_acceptance.py).

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


@dataclass
class OfflineAcceptance:
    budgets: list[int]
    width: int
    anchors: int = 0
    tree_accepted: dict[int, int] = field(default_factory=dict)  # budget -> accepted draft tokens, summed
    chain_accepted: int = 0  # width-1 chain of the whole block (the DFlash draft)
    depth_reached: list[int] = field(default_factory=list)  # [d]: anchors whose largest tree accepted >= d+1

    def add(self, nodes: list[int], chain: int) -> None:
        self.anchors += 1
        for b in self.budgets:
            self.tree_accepted[b] = self.tree_accepted.get(b, 0) + accepted_depth(nodes, b)
        self.chain_accepted += chain
        deepest = accepted_depth(nodes, max(self.budgets))
        self.depth_reached += [0] * (deepest - len(self.depth_reached))
        for d in range(deepest):
            self.depth_reached[d] += 1

    def summary(self) -> dict:
        """tau counts the bonus token (1 + accepted draft tokens per round), as ``jetflow bench`` does."""
        n = max(1, self.anchors)
        return {"anchors": self.anchors, "width": self.width,
                "tau": {str(b): 1 + self.tree_accepted.get(b, 0) / n for b in self.budgets},
                "chain_tau": 1 + self.chain_accepted / n,
                "depth_acceptance": [c / n for c in self.depth_reached]}


@torch.no_grad()
def offline_acceptance(head: DraftHead, target: TargetModel, sequences: list[Sequence], teacher, indices: list[int],
                       budgets: list[int], width: int = 7, anchors_per_seq: int = 16, seed: int = 0,
                       anchors: dict[int, torch.Tensor] | None = None) -> OfflineAcceptance:
    """Greedy acceptance of ``head`` over ``sequences[i]`` for i in ``indices``.

    ``teacher`` gives each sequence's tapped target features (an ``OnlineTeacher`` or ``CachedTeacher``).
    Anchors are ``anchors_per_seq`` random answer positions per sequence (seeded), or the given
    ``anchors[i]``. An anchor near the end can accept at most the tokens left in the sequence, as
    decoding stops there too."""
    if head.config.kind != "block":
        raise JetFlowError(f"offline acceptance needs a block head; this one is {head.config.kind!r} "
                           "(measure it with `jetflow bench`)")
    if not budgets or min(budgets) < 1:
        raise JetFlowError(f"budgets must be >= 1, got {budgets}")
    head = head.eval()
    embed = target.model.get_input_embeddings()
    lm_weight = head.output_weight(target.model.get_output_embeddings().weight)
    block, largest = head.config.block_size, max(budgets)
    result = OfflineAcceptance(sorted(budgets), width)
    g = torch.Generator().manual_seed(seed)
    for index in indices:
        seq = sequences[index]
        tokens = torch.tensor(seq.token_ids)
        picks = anchors[index] if anchors is not None else sample_anchors(seq.prompt_len, len(tokens),
                                                                         anchors_per_seq, g)
        if picks.numel() == 0:
            continue
        features, _ = teacher.fetch(index, seq, torch.zeros(0, dtype=torch.long))
        blocks = make_blocks(tokens, picks, block, head.config.mask_token_id)
        hidden = blocks_forward(head, embed, features, blocks).view(len(picks), block, -1)
        for k, a in enumerate(picks.tolist()):
            depth_lp = to_target_logprobs(hidden[k, 1:], lm_weight, head.draft_ids, target.vocab_size)
            continuation = seq.token_ids[a + 1:a + block]
            depth_lp = depth_lp[:len(continuation)]
            root = seq.token_ids[a]
            nodes = path_nodes(build_tree(depth_lp, root, largest, width), continuation)
            chain = len(path_nodes(build_tree(depth_lp, root, depth_lp.shape[0], 1), continuation))
            result.add(nodes, chain)
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
                      budgets=(16, 32, 64, 128, 256), width: int = 7, anchors_per_seq: int = 16,
                      seed: int = 0, log=print) -> dict:
    """Offline acceptance of each drafter checkpoint on a range of regenerated sequences (the same
    anchors for every drafter). Features come from ``teacher_cache`` or from the target run online."""
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
