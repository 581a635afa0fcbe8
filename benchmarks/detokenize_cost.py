"""What turning generated tokens into text costs per token: ``OutputStream.add`` (incremental
detokenization and stop checks) over recorded answers, warm, best of several passes per answer.
Every method of ``jetflow bench`` pays it inside its timing, ``llama-ar`` included.

    python benchmarks/detokenize_cost.py --records docs/results/headline_llamacpp_v13/runs/aime__llama-ar.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jetflow.decoding.output import OutputStream
from jetflow.models.loading import load_target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", required=True, help="a bench run's JSON (its records' token_ids are replayed)")
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    target = load_target("smollm2-135m-instruct", backend="llamacpp", n_threads=1)
    per_token_ms = []
    for record in json.load(open(args.records))["records"]:
        ids, best = record["token_ids"], float("inf")
        for _ in range(args.passes):
            out = OutputStream(target.tokenizer, max_new_tokens=len(ids) + 1, stop_token_ids=target.stop_token_ids())
            t = time.perf_counter()
            for token in ids:
                if out.add(token):
                    break
            best = min(best, (time.perf_counter() - t) / len(ids))
        per_token_ms.append(best * 1e3)
    print(f"{len(per_token_ms)} answers: OutputStream.add {statistics.median(per_token_ms) * 1e3:.1f} us per token "
          f"(median; max {max(per_token_ms) * 1e3:.1f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
