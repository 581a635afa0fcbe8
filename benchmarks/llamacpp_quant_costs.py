"""Would another quantization make speculation pay on llama.cpp? The verify cost curve per type.

A draft of n nodes pays only when the tokens a round emits exceed c(n+1)/c(1), the cost of
verifying n+1 tokens in one decode against a one-token step. This requantizes the target's GGUF to
each type asked for (with llama.cpp's own ``llama_model_quantize``; from the shipped file, so
Q4_1 -> other types, an approximation of quantizing the original weights) and measures that curve
for each, the same way ``--budget auto`` measures it (``jetflow.decoding.costs.measure_costs``:
medians after a 256-token random prefix, no features tapped).

    python benchmarks/llamacpp_quant_costs.py --quants Q4_0,Q8_0,IQ4_NL --out quant_costs.json
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

from jetflow.decoding.costs import measure_costs
from jetflow.models.gguf_meta import gguf_tokenizer
from jetflow.models.llamacpp_target import LlamaCppTarget
from jetflow.models.resolve import locate_gguf
from jetflow.utils.fs import write_json_atomic

FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "IQ4_NL": 25}  # llama_ftype values


def requantize(source: Path, quant: str, out_dir: Path) -> Path:
    import llama_cpp

    out = out_dir / f"{source.stem.rsplit('.', 1)[0]}.{quant}.gguf"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = FTYPES[quant], True
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {quant}")
    tmp.replace(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct", help="a GGUF file or a name the resolver knows")
    ap.add_argument("--quants", default="Q4_0,Q8_0,IQ4_NL", help=f"types besides the file's own: {', '.join(FTYPES)}")
    ap.add_argument("--budgets", default="1,2,3,4,8,16,32", help="draft nodes n: verify n + 1 tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "jetflow" / "quant"),
                    help="where the requantized files are kept")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unknown = [q for q in args.quants.split(",") if q not in FTYPES]
    if unknown:
        ap.error(f"unknown --quants {unknown}; choose from {', '.join(FTYPES)}")
    located = locate_gguf(args.target)
    if located is None:
        ap.error(f"--target {args.target!r} is not a GGUF file or a known GGUF target")
    source = Path(located[0])
    tokenizer = gguf_tokenizer(source)
    budgets = [int(b) for b in args.budgets.split(",")]
    files = {"as shipped": source, **{q: requantize(source, q, Path(args.cache_dir)) for q in args.quants.split(",")}}
    report = {"command": ["benchmarks/llamacpp_quant_costs.py", *sys.argv[1:]], "source": source.name,
              "threads": args.threads, "curves": {}}
    for label, path in files.items():
        target = LlamaCppTarget(path, tokenizer, name=label, n_threads=args.threads)
        measure_costs(target, budgets[:1], reps=3)  # warm-up: first decodes build the graph
        costs = measure_costs(target, budgets, reps=args.reps)
        report["curves"][label] = {"file": path.name, "bytes": path.stat().st_size, **costs}
        print(f"{label:10s} {path.stat().st_size / 2**20:6.1f} MiB  c(1) {costs['c1_ms']:6.2f} ms  c(n+1)/c(1): "
              + " ".join(f"n={n} {r:.2f}" for n, r in costs["verify_ratio"].items()), flush=True)
        del target
    if args.out:
        write_json_atomic(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
