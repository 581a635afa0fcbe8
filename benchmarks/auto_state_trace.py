"""What `--budget auto` has learned as one decoder serves one set after another: its cost scales,
plain-step cost, lookup calibration and the price of a typical lookup chain, printed after each set
(and after a few requests of the later sets), with the rounds it chose.

Greedy, every turn of each prompt (MT-Bench both turns), one process, `auto` alone.

    python benchmarks/auto_state_trace.py --backend llamacpp --datasets mtbench,humaneval --limit 20
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

import jetflow
from jetflow.eval.datasets import load_eval_set


def report(tag: str, decoder, kinds: collections.Counter) -> None:
    budget, cal, pooled = decoder.adaptive_budget(), decoder.drafter.rates, decoder.drafter.calibration
    print(f"== {tag}: rounds {dict(kinds)}  verify scale (plain, trees) {np.round(budget.verify_scales(), 3).tolist()}  "
          f"plain step {1 / budget.plain_rate():.2f} ms  verify of 1 / 3 nodes {budget.verify_cost(1):.2f} / "
          f"{budget.verify_cost(3):.2f} ms", flush=True)
    for row in range(1, pooled.trials.shape[0]):  # (rows: match lengths, mixed_drafter.MATCH_ROW_STARTS)
        print(f"   row {row}: rates d1-4 {np.round(cal.rates(row, 4), 3).tolist()}  "
              f"pooled trials d1-3 {np.round(pooled.trials[row, 1:4], 1).tolist()}", flush=True)
    scores = [0.0, *np.cumsum(cal.log_rates(pooled.trials.shape[0] - 1, 5)).tolist()]
    print(f"   a 5-token chain of the longest match: best prefix (nodes, tokens, ms) "
          f"{budget._best_chain_prefix(scores)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="llamacpp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--datasets", default="mtbench,humaneval")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    decoder = jetflow.JetFlow.from_pretrained(backend=args.backend, n_threads=args.threads, drafter="auto")
    if not hasattr(decoder.drafter, "calibration"):
        ap.error("the decoder has no lookup calibration (a drafter without prompt lookup)")
    for k, dataset in enumerate(args.datasets.split(",")):
        kinds = collections.Counter()
        for i, prompt in enumerate(load_eval_set(dataset, args.limit)):
            answers = []
            for _ in prompt.turns:
                result = decoder.generate(prompt.request(answers), budget="auto",
                                          max_new_tokens=args.max_new_tokens, chat=prompt.chat)
                answers.append(result.text)
                kinds.update(result.stats["round_kinds"])
            if k > 0 and i + 1 in (1, 5, 10):
                report(f"{dataset}, after {i + 1} prompts", decoder, kinds)
        report(dataset, decoder, kinds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
