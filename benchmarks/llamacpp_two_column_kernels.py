"""Two llama.cpp builds side by side: what JetFlow's two-column kernels (third_party/llama-cpp-python)
change in a verify's cost, and that they change no number.

    python benchmarks/llamacpp_two_column_kernels.py \
        --stock ~/.cache/jetflow/wheels/llama-cpp-python-0.3.36-nollamafile --rounds 6 \
        --out docs/results/llamacpp/two_column_kernels.json

The installed build is timed against ``--stock`` (a llama-cpp-python wheel, a directory holding one,
or a directory of its shared libraries), each in a fresh process loaded through
``LLAMA_CPP_LIB_PATH``, in rounds whose order alternates. A process measures c(n), one decode of n
chained tokens after ``--context`` tokens (median of ``--reps``, the drafted tokens dropped again:
what a verify of n - 1 draft nodes costs, as benchmarks/llamacpp_cost_curve.py), and checks that a
chained decode of each size gives the logits of the same tokens decoded one at a time, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)


def stock_libraries(spec: Path, into: Path) -> Path:
    """A directory with the stock build's shared libraries (extracted when ``spec`` is a wheel)."""
    spec = spec.expanduser()
    if spec.is_dir() and (spec / "libllama.so").exists():
        return spec
    wheels = sorted(spec.glob("llama_cpp_python-*.whl")) if spec.is_dir() else [spec]
    if not wheels or not wheels[0].is_file():
        raise SystemExit(f"--stock {spec}: no llama-cpp-python wheel or directory of its libraries there")
    with zipfile.ZipFile(wheels[0]) as whl:
        members = [m for m in whl.namelist() if m.startswith("llama_cpp/lib/") and not m.endswith("/")]
        if not members:
            raise SystemExit(f"--stock {wheels[0]}: the wheel holds no llama_cpp/lib/ libraries")
        for m in members:
            (into / Path(m).name).write_bytes(whl.read(m))
    return into


def child(args) -> None:
    """One build, one process: the cost curve and the bit-for-bit check, as one JSON line."""
    import torch
    from llamacpp_cost_curve import curve

    from jetflow.models.gguf_meta import gguf_tokenizer
    from jetflow.models.llamacpp_target import LlamaCppTarget, llama_build
    from jetflow.models.resolve import locate_gguf

    gguf, _ = locate_gguf(args.target)
    tokenizer = gguf_tokenizer(gguf)
    sizes = [int(n) for n in args.sizes.split(",")]
    c = curve(gguf, tokenizer, args.threads, args.context, args.reps, sizes=sizes)
    target = LlamaCppTarget(gguf, tokenizer, n_threads=args.threads)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(100, target.vocab_size, (args.context,), generator=g).tolist()
    exact = {}
    for n in sizes[1:]:
        tokens = torch.randint(100, target.vocab_size, (n,), generator=g).tolist()
        target.prefill(prefix, return_hidden=False)
        singles = torch.cat([target.extend([t]).logits for t in tokens])
        target.prefill(prefix, return_hidden=False)
        exact[n] = bool(torch.equal(target.extend(tokens).logits, singles))
    target.close()
    print(json.dumps({"build": llama_build(), "c_ms": c["c_ms"], "bit_for_bit": exact}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stock", type=Path, help="a stock llama-cpp-python wheel, a directory with one, or its lib dir")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    if args.stock is None:
        ap.error("--stock is required: the build to compare the installed one with")
    if args.out is not None:
        from jetflow.utils.fs import check_writable_file

        check_writable_file(args.out)

    with tempfile.TemporaryDirectory() as tmp:
        libs = {"installed": None, "stock": stock_libraries(args.stock, Path(tmp))}
        runs: dict[str, list[dict]] = {name: [] for name in libs}
        for r in range(args.rounds):
            for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                env = dict(os.environ)
                env.pop("LLAMA_CPP_LIB_PATH", None)
                if libs[name] is not None:
                    env["LLAMA_CPP_LIB_PATH"] = str(libs[name])
                cmd = [sys.executable, __file__, "--child", "--target", args.target, "--threads", str(args.threads),
                       "--context", str(args.context), "--reps", str(args.reps), "--sizes", args.sizes]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"the {name} build's process failed:\n{done.stderr[-3000:]}")
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                row = runs[name][-1]
                print(f"round {r + 1} {name:9s} columns={row['build']['quant_dot_columns']} "
                      + " ".join(f"{n}:{ms:.1f}" for n, ms in row["c_ms"].items())
                      + f"  bit for bit: {all(row['bit_for_bit'].values())}", flush=True)

    sizes = list(runs["installed"][0]["c_ms"])
    summary = {}
    for name, rows in runs.items():
        med = {n: statistics.median(row["c_ms"][n] for row in rows) for n in sizes}
        summary[name] = {"build": rows[0]["build"], "c_ms_median_of_rounds": med,
                         "ratio_to_one_token": {n: med[n] / med[sizes[0]] for n in sizes},
                         "bit_for_bit": all(all(row["bit_for_bit"].values()) for row in rows)}
    summary["installed_over_stock"] = {n: summary["installed"]["c_ms_median_of_rounds"][n]
                                       / summary["stock"]["c_ms_median_of_rounds"][n] for n in sizes}
    print(f"{'n':>4s} {'stock ms':>9s} {'installed ms':>13s} {'ratio':>6s} {'stock c(n)/c(1)':>16s} {'installed':>10s}")
    for n in sizes:
        print(f"{n:>4s} {summary['stock']['c_ms_median_of_rounds'][n]:9.2f} "
              f"{summary['installed']['c_ms_median_of_rounds'][n]:13.2f} {summary['installed_over_stock'][n]:6.2f} "
              f"{summary['stock']['ratio_to_one_token'][n]:16.2f} {summary['installed']['ratio_to_one_token'][n]:10.2f}")
    if args.out is not None:
        from jetflow.eval.machine import machine
        from jetflow.utils.fs import write_json_atomic

        write_json_atomic(args.out, {"command": ["python", "benchmarks/llamacpp_two_column_kernels.py", *sys.argv[1:]],
                                     "machine": machine(), "threads": args.threads, "context": args.context,
                                     "reps": args.reps, "rounds": runs, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
