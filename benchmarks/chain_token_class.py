"""Does the kind of token a lookup chain starts with tell how far the target follows it? A third
candidate predictor of a chain break (benchmarks/chain_predictors.py measured two), on a benchmark's
stored greedy outputs.

At every point of each output, the chain prompt lookup offers there (as ``auto`` builds it) is
grouped by its match-length row (``match_row``) and by its first token: one holding a digit, a
word (letters, maybe after a space), or anything else; the table gives how many tokens of it the
target followed (greedy output is fixed by the target, so that is known from the text).

    python benchmarks/chain_token_class.py docs/results/gsm8k100_llamacpp_v28 --datasets gsm8k \
        --out docs/results/lookup_pricing/chain_token_class_gsm8k100.json
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chain_predictors import requests  # noqa: E402

from jetflow.decoding.lookup_drafter import MAX_NGRAM, LookupIndex  # noqa: E402
from jetflow.decoding.mixed_drafter import MAX_CHAIN, common_prefix, match_row  # noqa: E402
from jetflow.models.gguf_meta import gguf_tokenizer  # noqa: E402
from jetflow.models.resolve import locate_gguf  # noqa: E402
from jetflow.utils.fs import write_json_atomic  # noqa: E402


def token_class(text: str) -> str:
    if re.search(r"\d", text):
        return "digit"
    return "word" if re.fullmatch(r"\s*[A-Za-z]+", text) else "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench_dir")
    ap.add_argument("--method", default="llama-ar", help="whose stored outputs are the target's text")
    ap.add_argument("--datasets", default="gsm8k")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gguf, _ = locate_gguf(args.target)
    tokenizer = gguf_tokenizer(gguf)
    cells: dict[tuple[str, int, str], list[int]] = {}  # (set, row, class) -> offers, followed, followed >= 1
    for name, prompt, output in requests(Path(args.bench_dir), args.method, args.datasets.split(","), tokenizer):
        index = LookupIndex(MAX_NGRAM)
        for i in range(len(output) - 1):
            index.sync(prompt + output[:i])
            length, chain = index.match(output[i], MAX_CHAIN)
            if chain:
                followed = common_prefix(chain, output[i + 1:])
                cell = cells.setdefault((name, match_row(length), token_class(tokenizer.decode([chain[0]]))), [0, 0, 0])
                cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + followed, cell[2] + (followed >= 1)
    out = {"bench_dir": args.bench_dir, "method": args.method, "cells": [
        {"set": s, "row": r, "first_token": c, "offers": v[0], "mean_followed": v[1] / v[0], "p_followed_1": v[2] / v[0]}
        for (s, r, c), v in sorted(cells.items())]}
    write_json_atomic(args.out, out)  # first: a closed pipe on the printout loses nothing
    for cell in out["cells"]:
        print(f"{cell['set']:10s} row {cell['row']:>2} {cell['first_token']:6s} {cell['offers']:5d} offers, "
              f"{cell['mean_followed']:.2f} followed, P(>=1) {cell['p_followed_1']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
