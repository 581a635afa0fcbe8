"""Lookup chains priced by `auto`, replayed on a benchmark's stored greedy outputs: which pricing of
chains would have spent the least verify time on the same text.

A greedy output is fixed by the target, so how far the target follows any chain offered at any
point is known from the output alone. This replays `auto`'s featureless rounds (no head forward:
a plain one-token step or a lookup chain alone) over the stored outputs of one method of a
`jetflow bench` directory (the prompts rebuilt from the same evaluation sets, later turns after
that method's own answers), with the real MixedDrafter (lookup index, pending chains, calibration)
and the real AdaptiveBudget chain pricing, against the cost curve that benchmark measured. Each
pricing is one arm; requests run in the benchmark's order with one decoder per arm, as in `auto`.
Time per round comes from the curve (a chain of n nodes costs a verify of n, plus ``--tree-overhead-ms``),
so this isolates the choice of chains from the machine's noise; it does not time anything. It also
counts, at every point of the text, the chain lookup offers and how far the target follows it, by
the match's length (what the chains' calibration rows group).

    python benchmarks/lookup_pricing_replay.py docs/results/headline_llamacpp_v16 \
        --priors default,none,4,8,16,oracle --out docs/results/lookup_pricing/v16.json

``--switch-ms`` also charges llama.cpp's graph rebuild whenever a decode's token count differs from
the round before's (a chain between one-token steps pays two), which the cost curve leaves out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from jetflow.decoding.budget import AdaptiveBudget
from jetflow.decoding.costs import CostCurve, _int_keys
from jetflow.decoding.lookup_drafter import MAX_NGRAM, LookupIndex
from jetflow.decoding.mixed_drafter import MAX_CHAIN, MixedDrafter, common_prefix
from jetflow.decoding.prompt import encode_prompt
from jetflow.eval.datasets import load_eval_set
from jetflow.models.resolve import resolve_model
from jetflow.utils.fs import write_json_atomic


class _NoHead:
    """The head drafter of a featureless request: never asked to draft."""
    head, block_size = None, 1

    def reset(self) -> None:
        pass

    def observe(self, tree, path) -> None:
        pass


class _Committed:
    token_ids: list[int] = []


def followed_path(tree, output: list[int]) -> list[int]:
    """The tree's nodes (root first) along ``output``, the target's tokens after the root."""
    path = [0]
    for token in output:
        child = tree.children[path[-1]].get(token)
        if child is None:
            break
        path.append(child)
    return path


def followed_by_match_length(prompt: list[int], output: list[int], table: dict) -> None:
    """Add to ``table`` (match length -> [offers, tokens followed]) the chain offered at every point
    of ``output``, and how far the target followed it (what MATCH_ROW_STARTS is grouped by)."""
    index = LookupIndex(MAX_NGRAM)
    for i in range(len(output) - 1):
        index.sync(prompt + output[:i])
        length, chain = index.match(output[i], MAX_CHAIN)
        if chain:
            row = table.setdefault(length, [0, 0])
            row[0] += 1
            row[1] += common_prefix(chain, output[i + 1:])


class _Offer:
    def __init__(self, tree):
        self.tree = tree


class Arm:
    """``prior``: as MixedDrafter's ``request_prior``, or "default"; "oracle": every offered chain cut
    where it would give the most tokens per ms given how far the target follows it (the bound for
    pricing)."""

    def __init__(self, prior: float | str | None, curve: CostCurve, tree_overhead_ms: float, switch_ms: float = 0.0,
                 price_switch: bool = False):
        self.oracle = prior == "oracle"
        self.committed = _Committed()
        # "default": as the code at hand decodes (what lets this script replay an older checkout too)
        kw = {} if prior in ("default", "oracle") else {"request_prior": prior}
        self.drafter = MixedDrafter(_NoHead(), self.committed, **kw)
        self.budget = AdaptiveBudget(curve)
        # ``price_switch``: a chain between one-token steps priced with both of its graph rebuilds
        # (lookup chains verified alone are priced with the chain rounds' overhead)
        self.budget.chain_overhead_ms = tree_overhead_ms + (2 * switch_ms if price_switch else 0.0)
        self.curve, self.tree_overhead_ms, self.switch_ms = curve, tree_overhead_ms, switch_ms
        self._shape = 1  # tokens of the latest decode: another shape rebuilds llama.cpp's graph
        self.ms = self.plain_ms = 0.0
        self.chains = self.chain_nodes = self.chain_tokens = 0

    def request(self, prompt: list[int], output: list[int]) -> None:
        """Decode ``output`` (the target's greedy tokens after ``prompt``) as featureless `auto` would."""
        self.drafter.reset()
        i = 0  # output[i] is the round's root (the target's latest token); output[:i] are committed
        while i < len(output) - 1:
            self.committed.token_ids = prompt + output[:i]
            offer = (self._oracle_offer(output, i) if self.oracle
                     else self.budget.lookup_chain(self.drafter, output[i], room=1 << 20))
            if offer is None:
                self.ms += self.curve.c1_ms + self._switch(1)
                i += 1
                continue
            path = followed_path(offer.tree, output[i + 1:])
            self.drafter.observe(offer.tree, path)
            nodes = len(offer.tree) - 1
            self.ms += self.curve.verify_ms(nodes) + self.tree_overhead_ms + self._switch(nodes + 1)
            self.chains, self.chain_nodes, self.chain_tokens = self.chains + 1, self.chain_nodes + nodes, self.chain_tokens + len(path)
            i += len(path)
        self.committed.token_ids = prompt + output[:-1]
        self.plain_ms += self.curve.c1_ms * (len(output) - 1)

    def _switch(self, tokens: int) -> float:
        switched, self._shape = tokens != self._shape, tokens
        return self.switch_ms if switched else 0.0

    def _oracle_offer(self, output: list[int], i: int):
        chain = self.drafter.propose_lookup(output[i], room=1 << 20)
        if chain is None:
            return None
        followed = common_prefix(chain.chain, output[i + 1:])
        if not followed:
            return None
        extra = self.tree_overhead_ms + 2 * self.switch_ms  # (both rebuilds, as if between one-token steps)
        n = max(range(1, followed + 1), key=lambda n: (n + 1) / (self.curve.verify_ms(n) + extra))
        if (n + 1) / (self.curve.verify_ms(n) + extra) <= 1 / self.curve.c1_ms:
            return None
        return _Offer(chain.tree(n))

    def summary(self) -> dict:
        return {"speedup_vs_plain": self.plain_ms / self.ms, "chains": self.chains,
                "nodes_per_chain": self.chain_nodes / max(1, self.chains),
                "tokens_per_chain": self.chain_tokens / max(1, self.chains)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench_dir", help="a `jetflow bench` output directory (runs/ and summary.json)")
    ap.add_argument("--method", default="llama-ar", help="whose stored outputs are the target's text")
    ap.add_argument("--datasets", default="gsm8k,mtbench,humaneval,math500,aime", help="in the order requests ran")
    ap.add_argument("--priors", default="default,none,4,8,16,oracle",
                    help="arms: pseudo-trials of the pooled rate behind a request's own counts; none: pooled only; "
                         "default: MixedDrafter's default; oracle: chains cut knowing how far the target follows them")
    ap.add_argument("--tree-overhead-ms", type=float, default=0.2,
                    help="Python time of a chain round beyond its verify (decoding/budget.py: about 0.2 ms on llama.cpp)")
    ap.add_argument("--switch-ms", type=float, default=0.0,
                    help="charge a graph rebuild of this many ms to every decode whose token count differs from the "
                         "round before (benchmarks/llamacpp_shape_switch.py); 0: free, as the cost curve has it")
    ap.add_argument("--price-switch", action="store_true",
                    help="also add the arms' pricing with both rebuilds of a chain between one-token steps "
                         "(named ARM+switch)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    root = Path(args.bench_dir)
    summary = json.loads((root / "summary.json").read_text())
    cost_model = summary["cost_model"]
    curve = CostCurve(_int_keys({"c1_ms": cost_model["c1_ms"], "verify_ms": cost_model["verify_ms"], "draft_ms": {}}))
    settings = summary["settings"]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(settings["target"]).path)
    priors = [None if p == "none" else p if p in ("oracle", "default") else float(p) for p in args.priors.split(",")]
    arms = {str(p).lower(): Arm(p, curve, args.tree_overhead_ms, args.switch_ms) for p in priors}
    if args.price_switch:
        arms |= {f"{str(p).lower()}+switch": Arm(p, curve, args.tree_overhead_ms, args.switch_ms, price_switch=True)
                 for p in priors if p != "oracle"}
    per_set: dict[str, dict] = {}
    by_length: dict[int, list[int]] = {}
    for name in args.datasets.split(","):
        records = json.loads((root / "runs" / f"{name}__{args.method}.json").read_text())["records"]
        by_turn = {(r["id"], r["turn"]): r for r in records}
        before = {p: (arm.ms, arm.plain_ms, arm.chains, arm.chain_nodes, arm.chain_tokens) for p, arm in arms.items()}
        mismatched = 0
        for prompt in load_eval_set(name, settings["limit"]):
            answers: list[str] = []
            for turn in range(len(prompt.turns)):
                record = by_turn[(prompt.id, turn)]
                output = json.loads(record["token_ids"]) if isinstance(record["token_ids"], str) else record["token_ids"]
                ids = encode_prompt(tokenizer, prompt.request(answers), chat=prompt.chat)
                mismatched += len(ids) != record["prompt_tokens"]
                for arm in arms.values():
                    arm.request(ids, output)
                followed_by_match_length(ids, output, by_length)
                answers.append(tokenizer.decode(output, skip_special_tokens=True))
        per_set[name] = {"prompts_rebuilt_with_other_lengths": mismatched}
        for p, arm in arms.items():
            ms, plain, chains, nodes, tokens = (now - then for now, then in zip(
                (arm.ms, arm.plain_ms, arm.chains, arm.chain_nodes, arm.chain_tokens), before[p]))
            per_set[name][str(p).lower()] = {"speedup_vs_plain": plain / ms, "chains": chains,
                                            "nodes_per_chain": nodes / max(1, chains), "tokens_per_chain": tokens / max(1, chains)}
        print(f"{name} ({mismatched} prompts rebuilt with another length): " + "; ".join(
            f"{str(p).lower()} {v['speedup_vs_plain']:.4f}x ({v['chains']} chains, {v['nodes_per_chain']:.2f} nodes, "
            f"{v['tokens_per_chain']:.2f} tokens)" for p, v in per_set[name].items() if isinstance(v, dict)))
    print("chains offered at every point of the text, by match length: " + "; ".join(
        f"{n}: {offers} offers, {followed / offers:.2f} tokens followed" for n, (offers, followed) in sorted(by_length.items())))
    out = {"bench_dir": str(root), "method": args.method, "tree_overhead_ms": args.tree_overhead_ms,
           "switch_ms": args.switch_ms,
           "cost_model": {"c1_ms": curve.c1_ms, "verify_ms": cost_model["verify_ms"]},
           "sets": per_set, "all": {str(p).lower(): arm.summary() for p, arm in arms.items()},
           "followed_by_match_length": {str(n): {"offers": offers, "mean_followed": followed / offers}
                                        for n, (offers, followed) in sorted(by_length.items())}}
    print("all: " + "; ".join(f"{p} {v['speedup_vs_plain']:.4f}x ({v['chains']} chains)" for p, v in out["all"].items()))
    write_json_atomic(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
