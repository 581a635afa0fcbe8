"""A `jetflow bench` run on llama.cpp, summed per set by whether `auto`'s request read the head's
features: seconds, prefill seconds and tokens/s of `llama-ar`, `ar` and `auto` on the same requests.
Featureless requests decode plainly (or with lookup chains), so they compare the loops alone; for
them also the lookup-chain rounds: how many, their mean nodes and the tokens each emitted (a chain
of n nodes pays where it emits more than c(n + 1) / c(1) tokens), and what they cost: `auto`'s verify
time less its plain rounds at `ar`'s time per token (decode only, so a little over a plain verify),
per chain round, in those steps. This estimate rests on `auto`'s plain rounds costing `ar`'s steps.
A run without `llama-ar` (a sampled one, or one that left it out) is summed without it, and one
without `ar` without the chains' cost.

    python benchmarks/split_by_features.py docs/results/headline_llamacpp_v13
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

METHODS = {"llama-ar": "llama-ar", "ar": "ar", "auto": "jetflow-lookup__bauto"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="the bench's --out directory")
    ap.add_argument("--datasets", default="gsm8k,mtbench,humaneval,math500,aime")
    args = ap.parse_args()
    for dataset in args.datasets.split(","):
        files = {name: Path(args.run) / "runs" / f"{dataset}__{file}.json" for name, file in METHODS.items()}
        if not files["auto"].is_file():
            raise SystemExit(f"{files['auto']} not found: the run has no `jetflow-lookup` at `auto` on {dataset}")
        stored = {name: json.load(open(path)) for name, path in files.items() if path.is_file()}
        temperature = stored["auto"]["key"].get("temperature")  # a run left from another temperature is not summed
        runs = {name: {(r["id"], r["turn"]): r for r in run["records"]} for name, run in stored.items()
                if run["key"].get("temperature") == temperature}
        kinds, sums = Counter(), defaultdict(float)
        for key, record in runs["auto"].items():
            features = bool(record["features"])
            kinds.update(record["round_kinds"] or {})
            if not features and record["accept_lengths"]:  # every round emitted 1 token but the chains'
                rounds = record["accept_lengths"]
                chains = (record["round_kinds"] or {}).get("lookup", 0)
                sums["chains"] += chains
                sums["chain_nodes"] += record["mean_tree_size"] * len(rounds)
                sums["chain_tokens"] += sum(rounds) - (len(rounds) - chains)
                sums["plain_rounds"] += len(rounds) - chains
                sums["auto_verify_s"] += (record.get("time_split") or {}).get("verify", 0.0)
                if "ar" in runs:
                    ar = runs["ar"][key]
                    sums["ar_decode_s"] += ar["seconds"] - (ar.get("prefill_seconds") or 0.0)
                    sums["ar_tokens"] += ar["new_tokens"]
            sums[features, "requests"] += 1
            for name, run in runs.items():
                sums[features, name, "s"] += run[key]["seconds"]
                sums[features, name, "prefill"] += run[key].get("prefill_seconds") or 0.0
                sums[features, name, "tokens"] += run[key]["new_tokens"]
        print(f"{dataset}: auto's rounds {dict(kinds)}")
        for features in (False, True):
            if sums[features, "requests"]:
                print(f"  {int(sums[features, 'requests'])} requests {'with' if features else 'without'} features: "
                      + "; ".join(f"{n} {sums[features, n, 'tokens'] / sums[features, n, 's']:.2f} tok/s, "
                                  f"{sums[features, n, 's']:.2f} s (prefill {sums[features, n, 'prefill']:.2f} s)"
                                  for n in runs))
        if sums["chains"]:
            print(f"  lookup-chain rounds without features: {int(sums['chains'])}, "
                  f"{sums['chain_nodes'] / sums['chains']:.2f} nodes and {sums['chain_tokens'] / sums['chains']:.2f} "
                  f"tokens each")
        if sums["chains"] and sums["ar_tokens"]:
            step = sums["ar_decode_s"] / sums["ar_tokens"]
            chain_s = (sums["auto_verify_s"] - sums["plain_rounds"] * step) / sums["chains"]
            print(f"  their verify, estimated: {chain_s * 1e3:.1f} ms each, {chain_s / step:.2f} of `ar`'s "
                  f"{step * 1e3:.2f} ms per token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
