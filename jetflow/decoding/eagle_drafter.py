"""Runs the EAGLE-3-style head during decoding: a dynamic draft tree grown by D sequential head
forwards (EAGLE-2's expansion), handed to the same one-pass tree verifier as the block heads.

Per round, with the anchor (the last token the target chose) at position p:

1. context: positions whose target features are known get their head keys/values cached, once;
2. depth 1: the anchor's input pairs its embedding with the target feature of position p-1;
3. depth d -> d+1: the ``width`` best nodes of depth d (by cumulative log-probability) are run in
   one forward, each with its own output state and its ancestors' keys/values, and offer their
   top-``width`` tokens as children;
4. every node found is ranked by cumulative log-probability; a budget-n tree is the first n + 1 of
   that order (a child never outranks its parent), exactly like the block heads' best-first trees.
"""

from __future__ import annotations

import copy
import heapq

import torch

from jetflow.models.backend import TargetBackend
from jetflow.models.draft_head import check_compatible
from jetflow.models.eagle_head import EagleHead
from jetflow.tree.build import DraftTree


class RankedProposal:
    """All candidate nodes of a round in descending score order; a budget takes a prefix."""

    def __init__(self, tree: DraftTree):
        self.full = tree

    def tree(self, budget: int) -> DraftTree:
        return self.full.prefix(budget + 1)


class EagleDrafter:
    def __init__(self, head: EagleHead, target: TargetBackend):
        check_compatible(head.config, target)
        target.set_tapped_layers(head.config.target_layer_ids)
        self.head = head.eval().requires_grad_(False)
        self.target = target
        self.embed = target.embed
        self.lm_weight = head.output_weight(target.lm_head_weight())
        self.draft_ids = head.draft_ids
        self.vocab_size = target.vocab_size
        self.block_size = head.config.block_size  # deepest level + 1, as for the block heads
        self.reset()

    def fork(self, target: TargetBackend) -> "EagleDrafter":
        """A drafter for another sequence (a batch's request, ``target`` its view): the same
        read-only weights, that sequence's committed tokens, an empty context."""
        twin = copy.copy(self)
        twin.target = target
        twin.reset()
        return twin

    def reset(self) -> None:
        self.fused: list[torch.Tensor] = []  # fused target feature per committed position (chunks)
        self.context_len = 0  # positions with a known target feature
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # head keys/values of cached positions
        self.kv_len = 0

    @torch.inference_mode()
    def extend(self, features: torch.Tensor) -> None:
        """Target features [n, taps*H] of newly committed positions (keys/values follow lazily)."""
        if features.shape[0]:
            self.fused.append(self.head.fuse(features))
            self.context_len += features.shape[0]

    def _feature(self, start: int, stop: int) -> torch.Tensor:
        """Fused features of positions start..stop-1 (zeros before position 0)."""
        allf = torch.cat(self.fused) if len(self.fused) > 1 else self.fused[0]
        self.fused = [allf]
        x = allf[max(start, 0):stop]
        if start < 0:
            x = torch.cat([x.new_zeros(-start, x.shape[-1]), x])
        return x

    def _token_logprobs(self, states: torch.Tensor) -> torch.Tensor:
        lp = self.head.logits(states, self.lm_weight).float().log_softmax(-1)
        if self.draft_ids is None:
            return lp
        full = lp.new_full((lp.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_ids, lp)

    def _cache_context(self, upto: int) -> None:
        """Keys/values of positions kv_len..upto-1: token t with the target feature of t-1."""
        if upto <= self.kv_len:
            return
        device = self.head.fc.weight.device
        tokens = torch.tensor(self.target.token_ids[self.kv_len:upto], device=device)
        x = self.head.step_input(self.embed(tokens), self._feature(self.kv_len - 1, upto - 1))
        n = upto - self.kv_len
        mask = torch.cat([torch.ones(n, self.kv_len, dtype=torch.bool, device=device),
                          torch.ones(n, n, dtype=torch.bool, device=device).tril()], dim=1)
        _, new = self.head(x, torch.arange(self.kv_len, upto, device=device), self.kv, mask)
        self.kv = new if self.kv is None else [(torch.cat([k, nk], -2), torch.cat([v, nv], -2))
                                              for (k, v), (nk, nv) in zip(self.kv, new)]
        self.kv_len = upto

    @torch.inference_mode()
    def observe(self, tree: DraftTree, path: list[int]) -> None:
        pass  # a head's drafts do not depend on how earlier rounds went

    def propose(self, anchor: int, position: int, room: int, width: int, max_nodes: int | None = None) -> RankedProposal:
        if position != self.context_len:
            raise RuntimeError(f"draft context holds {self.context_len} tokens but the anchor is at {position}")
        head, device = self.head, self.head.fc.weight.device
        self._cache_context(position)
        depth_limit = min(head.max_depth, room, max_nodes if max_nodes is not None else room)
        # Node arrays; node 0 is the anchor. KV of expanded nodes, in expansion order.
        tokens, parents, depths, scores = [anchor], [-1], [0], [0.0]
        states: dict[int, torch.Tensor] = {}
        kv_nodes: list[int] = []
        draft_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        frontier = [0]  # nodes to run at this step
        prev = self._feature(position - 1, position)  # the anchor's partner: target feature of p-1
        ancestors = {0: []}
        for depth in range(depth_limit):
            ids = torch.tensor([tokens[n] for n in frontier], device=device)
            prev_states = prev if depth == 0 else torch.stack([states[parents[n]] for n in frontier])
            x = head.step_input(self.embed(ids), prev_states)
            nf, nk = len(frontier), len(kv_nodes)
            row = {n: i for i, n in enumerate(kv_nodes)}
            tree_mask = torch.zeros(nf, nk + nf, dtype=torch.bool, device=device)
            for i, n in enumerate(frontier):
                for a in ancestors[n]:
                    tree_mask[i, row[a]] = True
                tree_mask[i, nk + i] = True
            mask = torch.cat([torch.ones(nf, self.kv_len, dtype=torch.bool, device=device), tree_mask], dim=1)
            past = self.kv if draft_kv is None else [(torch.cat([k, dk], -2), torch.cat([v, dv], -2))
                                                     for (k, v), (dk, dv) in zip(self.kv, draft_kv)]
            pos = torch.full((nf,), position + depth, device=device)
            out, new = head(x, pos, past, mask)
            draft_kv = new if draft_kv is None else [(torch.cat([dk, nk_], -2), torch.cat([dv, nv], -2))
                                                     for (dk, dv), (nk_, nv) in zip(draft_kv, new)]
            kv_nodes += frontier
            lp, ix = self._token_logprobs(out).topk(width, dim=-1)
            children = []
            for i, n in enumerate(frontier):
                states[n] = out[i]
                for score, token in zip(lp[i].tolist(), ix[i].tolist()):
                    if score == float("-inf"):
                        break
                    child = len(tokens)
                    tokens.append(token)
                    parents.append(n)
                    depths.append(depth + 1)
                    scores.append(scores[n] + score)
                    ancestors[child] = ancestors[n] + [n]
                    children.append(child)
            # EAGLE-2: only the best `width` new nodes are expanded at the next depth.
            frontier = heapq.nlargest(width, children, key=lambda c: scores[c])
            if not frontier:
                break
        # Rank every node (parents before children: a child's score never exceeds its parent's).
        order = sorted(range(len(tokens)), key=lambda n: (-scores[n], depths[n], n))
        index = {n: i for i, n in enumerate(order)}
        return RankedProposal(DraftTree([tokens[n] for n in order], [index[parents[n]] if n else -1 for n in order],
                                        [depths[n] for n in order], [scores[n] for n in order]))
