"""What might tell in advance how far the target follows a copied chain? Two candidates, measured on
a benchmark's stored greedy outputs.

1. **The target's confidence.** Before a lookup round, the target's distribution that produced the
   round's root is known (a plain step computed it). Teacher-forced through the llama.cpp target
   here, every point of each output gets its top-1 probability; the table groups the chain prompt
   lookup offers there (as ``auto`` builds it) by its match-length row (``match_row``) and that
   probability, with how many tokens the target followed.
2. **A datastore of the target's own answers** (retrieval drafting): the answers regenerated for
   training (``--data``, answers only), indexed by n-grams of several lengths. At every point of each
   output, the longest n-gram ending at the root that occurs there proposes the continuation most of
   its occurrences share (token by token), and the table gives how far the target followed it, by n.

Greedy output is fixed by the target, so how far it follows any chain is known from the text.

    python benchmarks/chain_predictors.py docs/results/headline_llamacpp_v17 \
        --data data/regenerated/smollm2-mix,data/regenerated/smollm2-mix2 \
        --out docs/results/lookup_pricing/chain_predictors_v17.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from jetflow.data.shards import list_shards, read_shard
from jetflow.decoding.lookup_drafter import MAX_NGRAM, LookupIndex
from jetflow.decoding.mixed_drafter import MATCH_ROW_STARTS, MAX_CHAIN, common_prefix, match_row
from jetflow.decoding.prompt import encode_prompt
from jetflow.decoding.sampling import SamplingParams
from jetflow.eval.datasets import load_eval_set
from jetflow.models.loading import load_target
from jetflow.utils.fs import write_json_atomic

CONFIDENCE_EDGES = (0.5, 0.8, 0.95, 0.99)  # top-1 probability buckets: < 0.5, 0.5-0.8, ...
DATASTORE_NGRAMS = (2, 3, 4, 6, 8, 12, 16)
SEPARATOR = -1


def requests(bench_dir: Path, method: str, datasets: list[str], tokenizer):
    """(set, prompt ids, output ids) of every request of the run, later turns after its own answers.
    A sampled run is refused: how far the target follows a chain is fixed by its greedy text only."""
    summary = json.loads((bench_dir / "summary.json").read_text())
    if not SamplingParams(summary["settings"]["temperature"]).greedy:
        raise SystemExit(f"{bench_dir}: a sampled run (temperature {summary['settings']['temperature']}); "
                         "these predictors read greedy outputs")
    for name in datasets:
        records = json.loads((bench_dir / "runs" / f"{name}__{method}.json").read_text())["records"]
        by_turn = {(r["id"], r["turn"]): r for r in records}
        for prompt in load_eval_set(name, summary["settings"]["limit"]):
            answers: list[str] = []
            for turn in range(len(prompt.turns)):
                record = by_turn[(prompt.id, turn)]
                output = record["token_ids"]
                output = json.loads(output) if isinstance(output, str) else output
                yield name, encode_prompt(tokenizer, prompt.request(answers), chat=prompt.chat), output
                answers.append(tokenizer.decode(output, skip_special_tokens=True))


def top1_probabilities(target, prompt: list[int], output: list[int]) -> np.ndarray:
    """P(output[i]) as the target's top-1 probability at the position before it, teacher-forced."""
    first = target.prefill(prompt, return_hidden=False).logits[-1:]
    rows = [first]
    if len(output) > 1:
        rows.append(target.verify(output[:-1], list(range(-1, len(output) - 2)), return_hidden=False).logits)
        target.commit([])
    logits = torch.cat(rows).double()
    return torch.softmax(logits, -1).max(-1).values.numpy()


class Datastore:
    """n-gram -> the positions where it ends, over answers joined by a separator (hashes, sorted)."""

    def __init__(self, answers: list[np.ndarray]):
        parts = []
        for a in answers:
            parts += [a.astype(np.int64), np.array([SEPARATOR])]
        self.tokens = np.concatenate(parts)
        self.index = {}
        n_tokens = self.tokens.size
        for n in DATASTORE_NGRAMS:
            windows = np.lib.stride_tricks.sliding_window_view(self.tokens, n)
            keep = (windows != SEPARATOR).all(1)
            keys = self._hashes(windows)[keep]
            ends = np.arange(n - 1, n_tokens)[keep]
            order = np.argsort(keys, kind="stable")
            self.index[n] = (keys[order], ends[order])

    @staticmethod
    def _hashes(windows: np.ndarray) -> np.ndarray:
        h = np.zeros(windows.shape[0], np.uint64)
        with np.errstate(over="ignore"):
            for k in range(windows.shape[1]):
                h = h * np.uint64(1000003) + windows[:, k].astype(np.uint64)
        return h.view(np.int64)

    def propose(self, context: list[int], max_chain: int) -> tuple[int, list[int]]:
        """(n, chain): the longest n-gram ending the context that occurs, and the continuation most
        of its occurrences share, token by token; (0, []) when none occurs."""
        for n in reversed(DATASTORE_NGRAMS):
            if len(context) < n:
                continue
            query = np.asarray(context[-n:], np.int64)
            keys, ends = self.index[n]
            key = self._hashes(query[None])[0]
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            at = np.array([e for e in ends[lo:hi] if (self.tokens[e - n + 1:e + 1] == query).all()], np.int64)
            if not at.size:
                continue
            chain = []
            while len(chain) < max_chain and at.size:
                following = self.tokens[np.minimum(at + 1, self.tokens.size - 1)]
                values, counts = np.unique(following, return_counts=True)
                token = int(values[counts.argmax()])
                if token == SEPARATOR:
                    break
                chain.append(token)
                at = at[following == token] + 1
            return n, chain
        return 0, []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench_dir")
    ap.add_argument("--method", default="llama-ar", help="whose stored outputs are the target's text")
    ap.add_argument("--datasets", default="gsm8k,mtbench,humaneval,math500,aime")
    ap.add_argument("--data", required=True, help="comma list of regenerated data directories (the datastore)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(None, backend="llamacpp", n_threads=args.threads)
    answers = [np.asarray(s.token_ids[s.prompt_len:]) for d in args.data.split(",")
               for shard in list_shards(Path(d)) for s in read_shard(shard)]
    store = Datastore(answers)
    rows = len(MATCH_ROW_STARTS)
    by_confidence = np.zeros((rows + 1, len(CONFIDENCE_EDGES) + 1, 2))  # [row, bucket] -> offers, followed
    by_ngram: dict[int, list[int]] = {}  # n -> offers, followed, followed >= 1, followed >= 4
    for name, prompt, output in requests(Path(args.bench_dir), args.method, args.datasets.split(","), target.tokenizer):
        confidence = top1_probabilities(target, prompt, output)
        index = LookupIndex(MAX_NGRAM)
        for i in range(len(output) - 1):
            index.sync(prompt + output[:i])
            length, chain = index.match(output[i], MAX_CHAIN)
            if chain:
                cell = by_confidence[match_row(length), int(np.searchsorted(CONFIDENCE_EDGES, confidence[i], "right"))]
                cell += (1, common_prefix(chain, output[i + 1:]))
            n, chain = store.propose(prompt + output[:i + 1], MAX_CHAIN)
            if chain:
                followed = common_prefix(chain, output[i + 1:])
                row = by_ngram.setdefault(n, [0, 0, 0, 0])
                row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + followed, row[2] + (followed >= 1), row[3] + (followed >= 4)
        print(f"{name}: {len(output)} tokens", flush=True)
    buckets = ["<0.5", "0.5-0.8", "0.8-0.95", "0.95-0.99", ">=0.99"]
    out = {"bench_dir": args.bench_dir, "method": args.method, "datastore_tokens": int(store.tokens.size),
           "lookup_followed_by_row_and_confidence": {
               str(r): {b: {"offers": int(by_confidence[r, k, 0]),
                            "mean_followed": float(by_confidence[r, k, 1] / by_confidence[r, k, 0]) if by_confidence[r, k, 0] else None}
                        for k, b in enumerate(buckets)} for r in range(1, rows + 1)},
           "datastore_followed_by_ngram": {str(n): {"offers": v[0], "mean_followed": v[1] / v[0], "p_followed_1": v[2] / v[0],
                                                    "p_followed_4": v[3] / v[0]} for n, v in sorted(by_ngram.items())}}
    print("lookup chains, mean tokens followed by match row (rows) and the root's top-1 probability (" + ", ".join(buckets) + "):")
    for r, cells in out["lookup_followed_by_row_and_confidence"].items():
        print(f"  row {r:>2}: " + "  ".join(f"{c['mean_followed']:5.2f} ({c['offers']:4d})" if c["offers"] else "   -        "
                                          for c in cells.values()))
    print(f"datastore of {store.tokens.size} tokens, by n-gram length:")
    for n, v in out["datastore_followed_by_ngram"].items():
        print(f"  n={n:>2}: {v['offers']} offers, {v['mean_followed']:.2f} followed, P(>=1) {v['p_followed_1']:.2f}, "
              f"P(>=4) {v['p_followed_4']:.2f}")
    write_json_atomic(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
