"""llama.cpp's fused attention kernel (`--flash-attn on`) against the default, side by side in one
run: the same GGUF loaded twice, once per kernel, and every prompt through each run in rotating
order (so a drift in the machine's speed falls on all alike). Runs: llama-cpp-python's own greedy
loop (`llama-ar`), JetFlow's plain loop (`ar`) and the default decoder (`jetflow-lookup` at
`auto`), each on both kernels. Speed-ups against `llama-ar` without the kernel, with 95% intervals
from a paired bootstrap over prompts; for each kernel, how many outputs differ from `llama-ar` on
the same kernel (the lossless check) and from the other kernel's.

    python benchmarks/llamacpp_flash_attn.py --datasets gsm8k,mtbench --limit 10 \
        --out docs/results/llamacpp/flash_attn.json
"""

from __future__ import annotations

import argparse
import dataclasses

from decoder_variants import VariantRunner  # (run from benchmarks/: its directory is on sys.path)

from jetflow.eval.datasets import load_eval_set
from jetflow.eval.harness import BenchSettings, compare_rows, run_side_by_side
from jetflow.eval.machine import machine
from jetflow.eval.methods import METHODS, MethodRunner
from jetflow.models.checkpoint import load_drafter
from jetflow.models.loading import load_target
from jetflow.models.shipped import shipped_drafter
from jetflow.utils.fs import write_json_atomic

KERNELS = ("off", "on")


def differing(a: dict, b: dict) -> int:
    """Outputs (prompt turns) of run ``a`` whose tokens differ from run ``b``'s."""
    return sum(x["token_ids"] != y["token_ids"] for x, y in zip(a["records"], b["records"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--datasets", default="gsm8k")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runners = {}
    for kernel in KERNELS:
        target = load_target(args.target, backend="llamacpp", n_threads=args.threads, flash_attn=kernel == "on")
        head = load_drafter(shipped_drafter(target.name), target=target, device=target.device)
        runners[kernel] = MethodRunner(target, {"causal": head})
    names = [("llama-ar", None), ("ar", None), ("jetflow-lookup", "auto")]
    runs = [(dataclasses.replace(METHODS[m], name=f"{m}/{k}"), b) for m, b in names for k in KERNELS]
    settings = BenchSettings(target=args.target, drafters={}, max_new_tokens=args.max_new_tokens)
    result = {"machine": machine(), "settings": vars(args), "datasets": {}}
    for dataset in args.datasets.split(","):
        rows = run_side_by_side(VariantRunner(runners), runs, load_eval_set(dataset, args.limit), settings, dataset)
        base = rows["llama-ar/off"]
        report = {}
        for name, row in rows.items():
            method, _, kernel = name.split("@")[0].partition("/")
            other = "on" if kernel == "off" else "off"
            report[name] = {"tokens_per_s": row["summary"]["tokens_per_s"], "tau": row["summary"]["tau"],
                            "against_llama_ar_off": compare_rows(row, base),
                            "differ_from_llama_ar_same_kernel": differing(row, rows[f"llama-ar/{kernel}"]),
                            "differ_from_other_kernel": differing(row, rows[name.replace(f"/{kernel}", f"/{other}")]),
                            "outputs": len(row["records"])}
            r = report[name]
            print(f"{dataset:8s} {name:28s} {r['tokens_per_s']:6.1f} tok/s  {r['against_llama_ar_off']['ratio']:.2f}x "
                  f"[{r['against_llama_ar_off']['ci95'][0]:.2f}-{r['against_llama_ar_off']['ci95'][1]:.2f}] of "
                  f"llama-ar/off; differ from llama-ar/{kernel}: {r['differ_from_llama_ar_same_kernel']}, "
                  f"from the other kernel: {r['differ_from_other_kernel']} of {r['outputs']}")
        result["datasets"][dataset] = {"report": report, "rows": rows}
    write_json_atomic(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
