"""Acceptance of a block draft head measured offline, on sequences the target generated greedily.

On such a sequence, greedy speculative decoding from an anchor accepts exactly the longest prefix of
the sequence's own continuation that lies in the round's draft tree: at every node the target's
argmax *is* the next data token. So decoding can be replayed without the target: head forwards over
the sequence's anchors (batched, as in training), one best-first tree per round, the next round
right after the bonus token. That reproduces decoding's rounds and tau exactly (tested round by round
against the decoding loop, tests/test_offline_acceptance.py) at a fraction of the cost, which is
what ablations between heads need. Uniform random anchors are an option; they weight every position
alike, while decoding spends more rounds where drafts fail, so their tau reads higher.

With ``lookup``, each round's tree is the head's merged with the prompt-lookup chain, as the default
decoder builds it (decoding/mixed_drafter.py): the chain is looked up in the sequence up to the
anchor, and the lookup calibration learns from the replayed rounds, fresh for each sequence (one
request). Also tested round by round against decoding.

Only block heads: an autoregressive (eagle3) head drafts each depth from its own path, so its tree
needs the decoding loop (``jetflow bench``). A head's path-conditioned second pass (decoding/refine.py)
is replayed too when the head shifts tokens: it is then one more block per anchor, [anchor, first
pass's path, MASK], batched like the first pass. So is the tree-conditioned pass (``refine="tree[:N]"``),
whose slots are the nodes of each round's first tree: it runs per round and per budget, through the
decoder's own code (decoding/refine.py) over the sequence's context cut at the anchor.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from jetflow.data.shards import Sequence
from jetflow.decoding.block_drafter import BlockProposal, draft_logprobs
from jetflow.decoding.lookup_drafter import MAX_NGRAM, lookup_match
from jetflow.decoding.mixed_drafter import (LOOKUP_WINDOW, MATCH_ROW_STARTS, MAX_CHAIN, REQUEST_PRIOR,
                                             LookupCalibration, MixedProposal, PendingChains, RequestCalibration,
                                             chain_followed, match_row)
from jetflow.decoding.refine import path_rows, repath, tree_passes, tree_refined_proposal
from jetflow.errors import JetFlowError
from jetflow.eval.replay_journal import ReplayJournal
from jetflow.models.checkpoint import head_fingerprint, load_drafter
from jetflow.models.draft_head import DraftHead
from jetflow.models.draft_vocab import target_to_draft_index
from jetflow.models.target import TargetModel
from jetflow.training.block_objective import block_context, blocks_forward
from jetflow.training.blocks import make_blocks, sample_anchors
from jetflow.tree.build import DraftTree, build_tree, build_tree_rows


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


class _HeadTree:
    """A replayed round's best-first head tree (draft-vocabulary ids) as the proposal the mixed
    drafter merges lookup into: any budget's tree, in target ids."""

    def __init__(self, tree: DraftTree, root: int, draft_ids: torch.Tensor | None):
        self.full, self.root, self.draft_ids = tree, root, draft_ids

    def tree(self, budget: int) -> DraftTree:
        t = self.full.prefix(budget + 1)
        ids = t.tokens[1:] if self.draft_ids is None else self.draft_ids[t.tokens[1:]].tolist()
        return DraftTree([self.root, *ids], t.parents, t.depths, t.scores)


@dataclass
class OfflineAcceptance:
    budgets: list[int]
    width: int
    mode: str  # "decode": rounds where decoding puts them; "uniform": random anchors
    lookup: bool = False  # trees merged with the prompt-lookup chain (the chain column stays the head's)
    depths: dict = field(default_factory=dict)  # budget or CHAIN -> accepted draft tokens of each round
    depth_reached: list[int] = field(default_factory=list)  # [d]: rounds of the largest budget accepting >= d+1
    seconds: float = 0.0  # spent replaying the sequences (journaled ones: when they were replayed)

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
        return {"mode": self.mode, "width": self.width, "lookup": self.lookup,
                "rounds": {str(b): self.rounds.get(b, 0) for b in [*self.budgets, CHAIN]},
                "tau": {str(b): self.tau(b) for b in self.budgets},
                "chain_tau": self.tau(CHAIN),
                "depth_acceptance": [c / max(1, largest) for c in self.depth_reached]}


class _DrafterAt:
    """What the tree-conditioned pass (decoding/refine.py) reads from a decoding ``BlockDrafter``,
    taken from a replayed sequence's context cut right before ``anchor``: the decoder's own pass
    then runs unchanged."""

    def __init__(self, rounds: "ReplayRounds", anchor: int):
        fused, kv = rounds.context
        self.head = self.run_head = rounds.head
        self.embed, self.lm_weight, self.draft_ids = rounds.embed, rounds.lm_weight, rounds.head.draft_ids
        self.context_kv = [(k[..., :anchor, :], v[..., :anchor, :]) for k, v in kv]
        self.context_len, self.last_feature = anchor, fused[anchor - 1]

    def _output_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return draft_logprobs(hidden, self.lm_weight)

    def proposal(self, depth_logprobs: torch.Tensor, anchor: int, width: int) -> BlockProposal:
        return BlockProposal(depth_logprobs, anchor, width, self.draft_ids)


class ReplayRounds:
    """Accepted draft tokens of a round at any anchor of one sequence, for every budget.

    Per anchor, one best-first tree at the largest budget serves all budgets (a smaller budget's
    tree is its prefix), plus the chain. Head forwards run over chunks of anchors when a walk first
    reaches one. Trees live in the head's own vocabulary; the continuation is mapped into it (a token
    outside a reduced vocabulary can never be drafted).

    With ``tree_refine`` N > 0, a round's tree depends on its budget (the pass conditions the first
    tree of that budget), so each (anchor, budget) gets its own tree, in target ids."""

    def __init__(self, head, embed, lm_weight, draft_index, features, seq, largest: int, width: int,
                 chunk: int = 16, refine: int = 0, calibration=None,
                 tree_refine: int = 0):  # small chunks: the block-to-block mask grows as chunk^2
        self.head, self.embed, self.lm_weight, self.features = head, embed, lm_weight, features
        self.tree_refine = tree_refine
        self.first: dict[int, torch.Tensor] = {}  # anchor -> first-pass rows [B-1, Vd] (tree_refine only)
        self.tokens = torch.tensor(seq.token_ids)
        ids = self.tokens if draft_index is None else draft_index[self.tokens]
        self.ids = ids.tolist()  # the sequence in draft-vocabulary ids (-1: outside it)
        self.largest, self.width, self.chunk, self.refine = largest, width, chunk, refine
        self.calibration = calibration  # the head's tree calibration, as decoding uses it (None: none)
        self.block = head.config.block_size
        self.paths: dict[int, tuple[list[int], int]] = {}  # anchor -> (tree path nodes, chain length)
        self.trees: dict[int, DraftTree] = {}  # anchor -> its tree at the largest budget (kept for lookup)
        self.draft_ids = None if head.draft_ids is None else head.draft_ids.cpu()
        self.context = None

    def first_pass(self, anchors: list[int]):
        """The head's blocks at ``anchors`` and their depth log-probabilities [K, B-1, Vd]."""
        blocks = make_blocks(self.tokens, torch.tensor(anchors), self.block, self.head.config.mask_token_id)
        if self.context is None:
            self.context = block_context(self.head, self.features)
        return blocks, self._depth_logprobs(blocks)

    def _fill(self, anchors: list[int]) -> None:
        picks = torch.tensor(anchors)
        blocks, logprobs = self.first_pass(anchors)  # [K, B-1, Vd]
        second = None
        path = logprobs.argmax(-1)  # draft ids
        for n in range(self.refine):  # [anchor, t1..t(B-1)]: slot j+1 reads t_j, a causal head's row after t1..tj
            if n:
                path = repath(path, second)  # as decoding's passes (their early stop changes nothing here)
            path_ids = path if self.head.draft_ids is None else self.head.draft_ids.to(path.device)[path]
            blocks.block_ids.view(len(picks), self.block)[:, 1:] = path_ids.cpu()
            second = self._depth_logprobs(blocks)[:, 1:]  # [K, B-2, Vd]: depths 2..B-1 after the path
        for k, a in enumerate(anchors):
            continuation = self.ids[a + 1:a + self.block]
            d = len(continuation)
            depth_lp = logprobs[k, :d]
            chain = path_nodes(build_tree(depth_lp, self.ids[a], depth_lp.shape[0], 1), continuation)
            if self.tree_refine:  # trees are built per budget (tree_refined); all depths: decoding drafts past the data's end
                self.first[a], self.paths[a] = logprobs[k], ([], len(chain))
                continue
            if second is None:
                tree = build_tree(depth_lp, self.ids[a], self.largest, self.width, calibration=self.calibration)
            else:
                rows = torch.cat([depth_lp, second[k, :d - 1]])
                tree = build_tree_rows(rows, path_rows(d, path[k, :d].tolist()), self.ids[a], self.largest, self.width)
            self.paths[a] = (path_nodes(tree, continuation), len(chain))
            self.trees[a] = tree

    def _depth_logprobs(self, blocks) -> torch.Tensor:
        hidden = blocks_forward(self.head, self.embed, self.features, blocks, self.context)
        return draft_logprobs(hidden.view(len(blocks.anchors), self.block, -1)[:, 1:], self.lm_weight)

    def prefetch(self, anchors: list[int]) -> None:
        """Compute the given anchors not yet known, ``chunk`` per head forward."""
        todo = [a for a in anchors if a not in self.paths]
        for i in range(0, len(todo), self.chunk):
            self._fill(todo[i:i + self.chunk])

    def accepted(self, anchor: int, budget) -> int:
        self._walk_to(anchor)
        tree, chain = self.paths[anchor]
        if budget != CHAIN and self.tree_refine:
            refined = self.tree_refined(anchor, budget).tree(budget)
            return len(path_nodes(refined, self.tokens[anchor + 1:anchor + 1 + refined.max_depth].tolist()))
        return chain if budget == CHAIN else accepted_depth(tree, budget)

    def tree_refined(self, anchor: int, budget: int):
        """The tree-conditioned proposal of the round at ``anchor`` for ``budget`` nodes, as decoding
        makes it (``BlockDrafter.propose`` with ``refine="tree[:N]"``)."""
        first = self.first[anchor][:budget]  # a causal head drafts at most as deep as the budget
        return tree_refined_proposal(_DrafterAt(self, anchor), int(self.tokens[anchor]), anchor, first, self.width,
                                     budget, self.tree_refine)

    def accepted_with_lookup(self, anchor: int, budget: int, pending: PendingChains) -> int:
        """Draft tokens accepted from the head's tree merged with the lookup chain (as
        MixedDrafter.propose builds it), and the round counted into ``pending.calibration`` as
        decoding does (chains decided later are counted later, as there)."""
        self._walk_to(anchor)
        history = self.tokens[:anchor + 1].numpy()
        pending.tick(history[:anchor], int(history[anchor]))
        lookup_rates = pending.calibration
        length, chain = lookup_match(history, MAX_NGRAM, MAX_CHAIN)
        row = match_row(length)
        root = int(self.tokens[anchor])
        head = self.tree_refined(anchor, budget) if self.tree_refine else _HeadTree(self.trees[anchor], root,
                                                                                    self.draft_ids)
        proposal = MixedProposal(head, root, chain, lookup_rates.log_rates(row, len(chain)))
        tree = proposal.tree(budget)
        nodes = path_nodes(tree, self.tokens[anchor + 1:anchor + 1 + tree.max_depth].tolist())
        if chain and len(tree) > 1:
            verified = len(path_nodes(tree, chain))
            pending.observe_verified(row, chain, anchor + 1, verified, chain_followed(chain, tree, [0, *nodes]))
        return len(nodes)

    def _walk_to(self, anchor: int) -> None:
        if anchor not in self.paths:  # a walk: the next anchors are likely ones, batch them
            self.prefetch(list(range(anchor, min(len(self.ids) - 2, anchor + self.chunk - 1) + 1)))


@torch.no_grad()
def offline_acceptance(head: DraftHead, target: TargetModel, sequences: list[Sequence], teacher, indices: list[int],
                       budgets: list[int], width: int = 7, anchors_per_seq: int = 0, seed: int = 0,
                       anchors: dict[int, torch.Tensor] | None = None, refine: bool | int | None = None,
                       lookup: bool = False, calibrated: bool = True, lookup_session: bool = False,
                       journal: ReplayJournal | None = None, journal_key: str = "", progress: str | None = None
                       ) -> OfflineAcceptance:
    """Greedy acceptance of ``head`` over ``sequences[i]`` for i in ``indices``.

    ``teacher`` gives each sequence's tapped target features (an ``OnlineTeacher`` or ``CachedTeacher``).
    Rounds are placed where greedy decoding places them (``anchors_per_seq=0``, the default): the
    first at the answer's first token, each next one right after the previous round's bonus token,
    separately per budget -- this reproduces decoding's tau. Otherwise each sequence gets
    ``anchors_per_seq`` random answer anchors (seeded), or the given ``anchors[i]``, shared by all
    budgets. A round near the end accepts at most the tokens left in the sequence. ``refine``:
    replay the path-conditioned second pass (an int N: N passes, as decoding's ``refine=N``; "tree"
    or "tree:N": the tree-conditioned pass, as decoding's ``refine="tree[:N]"``; None: when decoding
    would run it, ``config.path_refine``); only for heads that shift tokens. The chain stays the
    first pass's. ``lookup``: the trees hold the prompt-lookup chain too (decoding's
    default; only where decoding puts the rounds), its calibration fresh per sequence as for a new
    request; with ``lookup_session`` its counts carry over from one sequence to the next, as when
    one ``JetFlow`` object answers them in order (each sequence's rates shrunk from them towards its
    own, as decoding's are). ``calibrated``:
    build the trees with the head's tree calibration when it has one (as decoding does).
    ``journal``: sequences it holds (under ``journal_key``) are read from it, the others recorded in it
    as they finish (eval/replay_journal.py). ``progress``: a progress bar on stderr with that label."""
    check_replayable(head, budgets, refine, lookup, lookup_session, anchors is not None or bool(anchors_per_seq))
    tree_refine = tree_passes(refine)  # tree-conditioned passes ("tree[:N]"), else 0
    refine = tree_refine or int(head.config.path_refine if refine is None else refine)  # passes after the first
    head = head.eval()
    embed = target.embed
    lm_weight = head.output_weight(target.lm_head_weight())
    draft_index = None if head.draft_ids is None else target_to_draft_index(head.draft_ids.cpu(), target.vocab_size)
    budgets = sorted(budgets)
    calibration = head.config.calibration if calibrated and not refine else None
    walk = anchors is None and anchors_per_seq == 0
    result = OfflineAcceptance(budgets, width, "decode" if walk else "uniform", lookup=lookup)
    g = torch.Generator().manual_seed(seed)
    # (remembering as many trials per cell as a decoder's pooled counts do: decoding/mixed_drafter.py)
    session = {arm: LookupCalibration(window=LOOKUP_WINDOW) for arm in budgets} if lookup_session else None
    for index in tqdm(indices, desc=progress or "replay", unit="seq", disable=not progress, file=sys.stderr):
        seq = sequences[index]
        last = len(seq.token_ids) - 2  # the last anchor with a token after it
        if last < seq.prompt_len:
            continue
        picks = None
        if not walk:  # drawn for every sequence, resumed or not, so the generator stays where it was
            picks = anchors[index] if anchors is not None else sample_anchors(seq.prompt_len, len(seq.token_ids),
                                                                             anchors_per_seq, g)
        entry = journal.get(journal_key, index) if journal is not None else None
        if entry is not None:  # replayed before the run was interrupted
            for arm, depths in entry["depths"].items():
                for depth in depths:
                    result.add(arm, depth)
            if session is not None:
                for arm, cal in session.items():
                    cal.load_counts(entry["session"][arm])
            result.seconds += entry["seconds"]
            continue
        t0 = time.perf_counter()
        depths: dict = {}

        def add(arm, depth: int) -> None:
            result.add(arm, depth)
            depths.setdefault(arm, []).append(depth)

        features, _ = teacher.fetch(index, seq, torch.zeros(0, dtype=torch.long))
        rounds = ReplayRounds(head, embed, lm_weight, draft_index, features, seq, budgets[-1], width,
                              refine=0 if tree_refine else refine, calibration=calibration, tree_refine=tree_refine)
        if walk:
            for arm in [*budgets, CHAIN]:
                lookup_rates = None
                if lookup and arm != CHAIN:  # one per request, or one for the whole session
                    lookup_rates = RequestCalibration(session[arm] if session is not None else LookupCalibration())
                pending = PendingChains(lookup_rates) if lookup_rates is not None else None
                a = previous = seq.prompt_len
                while a <= last:
                    depth = rounds.accepted(a, arm) if pending is None else rounds.accepted_with_lookup(a, arm, pending)
                    add(arm, depth)
                    a, previous = a + depth + 1, a
                if pending is not None and pending.chains:  # the request ends (decoding: the drafter's reset)
                    pending.follow(rounds.tokens[:previous].tolist(), int(rounds.tokens[previous]))
        else:
            rounds.prefetch(picks.tolist())
            for a in picks.tolist():
                for arm in [*budgets, CHAIN]:
                    add(arm, rounds.accepted(a, arm))
        spent = time.perf_counter() - t0
        result.seconds += spent
        if journal is not None:
            journal.record(journal_key, index, depths, spent, session)
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


def eval_teacher(target: TargetModel, sequences: list[Sequence], end: int, teacher_cache, layer_ids):
    """The teacher an offline evaluation of sequences [.., end) reads: the target run online, or
    ``teacher_cache`` handed whole parts up to ``end`` (the cache checks its parts against the data)."""
    from jetflow.training.teacher import CachedTeacher, OnlineTeacher
    from jetflow.training.teacher_cache import TeacherCache

    if teacher_cache is None:
        return OnlineTeacher(target, None)
    m = TeacherCache.read_manifest(teacher_cache)
    per, cached = m["sequences_per_part"], m.get("num_sequences", len(sequences))
    covered = sequences[:max(end, min(len(sequences), cached, -(-end // per) * per))]
    return CachedTeacher(TeacherCache(teacher_cache, covered, target, layer_ids), None, target.vocab_size,
                         target.device)


def check_replayable(head, budgets, refine, lookup: bool, lookup_session: bool, anchored: bool) -> None:
    """JetFlowError when :func:`offline_acceptance` cannot replay ``head`` so (checked for every head
    before any replays: a later head's refusal must not come after an hour of the earlier ones')."""
    if head.config.kind != "block":
        raise JetFlowError(f"offline acceptance needs a block head; this one is {head.config.kind!r} "
                           "(measure it with `jetflow bench`)")
    passes = tree_passes(refine) or int(head.config.path_refine if refine is None else refine)
    if passes and not (head.config.shift_tokens and head.config.attention == "causal"):
        raise JetFlowError("offline replay of the second pass needs a causal head trained with --shift-tokens; "
                           "measure this one's first pass (--no-refine) or decode it with `jetflow bench`")
    if not budgets or min(budgets) < 1:
        raise JetFlowError(f"budgets must be >= 1, got {budgets}")
    if lookup_session and not lookup:
        raise JetFlowError("lookup_session carries the lookup calibration over; it needs lookup")
    if lookup and anchored:
        raise JetFlowError("the lookup replay follows decoding's rounds (its calibration learns from them); "
                           "it cannot use random or given anchors")


def evaluate_drafters(target: TargetModel, drafters: list[str], data_dir, teacher_cache=None, seq_range=None,
                      budgets=(16, 32, 64, 128, 256), width: int = 7, anchors_per_seq: int = 0,
                      seed: int = 0, log=print, refine: bool | int | None = None, lookup: bool = False,
                      calibrated: bool = True, lookup_session: bool = False, journal: str | Path | None = None,
                      progress: bool = False) -> dict:
    """Offline acceptance of each drafter checkpoint on a range of regenerated sequences (rounds where
    decoding puts them, or the same random anchors for every drafter). Features come from
    ``teacher_cache`` or from the target run online. ``journal``: a file that makes the replay
    resumable (eval/replay_journal.py); it is removed once the report is complete."""
    from jetflow.training.teacher_cache import tokens_digest
    from jetflow.training.trainer import data_label, load_sequences

    sequences = load_sequences(data_dir, target)
    start, end = parse_range(seq_range, len(sequences))
    heads = {path: load_drafter(path, target=target, device=target.device, dtype=torch.float32)
             for path in drafters}
    for path, head in heads.items():
        try:
            check_replayable(head, budgets, refine, lookup, lookup_session, bool(anchors_per_seq))
        except JetFlowError as e:
            raise JetFlowError(f"{path}: {e}") from None
    header = {"data": data_label(data_dir), "teacher_cache": None if teacher_cache is None else str(teacher_cache),
              "sequences": [start, end], "anchors_per_seq": anchors_per_seq, "seed": seed, "width": width,
              "budgets": list(budgets)}
    book = None
    if journal is not None:  # what a resumed replay must share with the one it resumes
        book = ReplayJournal(journal, {
            **header, "tokens": tokens_digest(sequences[start:end]), "refine": refine, "lookup": lookup,
            "lookup_session": lookup_session, "calibrated": calibrated, "target": target.name,
            "dtype": str(target.dtype).removeprefix("torch."),
            # how lookup chains are priced (a journal of another pricing holds other depths)
            **({"lookup_pricing": {"rows": list(MATCH_ROW_STARTS), "request_prior": REQUEST_PRIOR}} if lookup else {}),
            "drafters": {str(path): head_fingerprint(path) for path in drafters}})
    if book is not None and any(book.done(str(path)) for path in drafters):
        log(f"resuming from {book.path}: " + ", ".join(f"{path}: {book.done(str(path))} sequences done"
                                                      for path in drafters))
    results = {}
    for path, head in heads.items():
        target.set_tapped_layers(head.config.target_layer_ids)
        teacher = eval_teacher(target, sequences, end, teacher_cache, head.config.target_layer_ids)
        passes = refine if tree_passes(refine) else int(head.config.path_refine if refine is None else refine)
        result = offline_acceptance(head, target, sequences, teacher, list(range(start, end)), list(budgets),
                                    width, anchors_per_seq, seed, refine=refine, lookup=lookup, calibrated=calibrated,
                                    lookup_session=lookup_session, journal=book, journal_key=str(path),
                                    progress=Path(path).name if progress else None)
        results[str(path)] = {**result.summary(), "seconds": round(result.seconds, 1),
                              "lookup_session": lookup_session,
                              "refine": passes,
                              # as the replay ran: a calibration only trees of the first pass alone use
                              "calibrated": calibrated and not passes and head.config.tree_calibration is not None}
        log(f"{path}: chain tau {results[str(path)]['chain_tau']:.2f}, tree tau "
            + ", ".join(f"{b}: {t:.2f}" for b, t in results[str(path)]["tau"].items()))
    return {**header, "drafters": results}


