"""Two llama.cpp builds side by side: what a change to ggml's CPU kernels (JetFlow's patch,
third_party/llama-cpp-python) does to a verify's cost, and that it changes no number.

    python benchmarks/llamacpp_build_vs_build.py \
        --against <a llama-cpp-python wheel built without the patch, or with its first version> --rounds 6 \
        --out docs/results/llamacpp/build_vs_build.json

The installed build is timed against ``--against`` (a llama-cpp-python wheel, a directory holding one,
or a directory of its shared libraries), each in a fresh process loaded through
``LLAMA_CPP_LIB_PATH``, in rounds whose order alternates. A process measures c(n), one decode of n
chained tokens after ``--context`` tokens with the drafted tokens dropped again (what a verify of
n - 1 draft nodes costs, as benchmarks/llamacpp_cost_curve.py), for every size in turn, ``--reps``
times, so that a drift of the machine's speed reaches every size alike: c(n) is the median over the
turns, c(n)/c(1) the median of each turn's own ratio. It then checks that a chained decode of each
size gives the logits of the same tokens decoded one at a time, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)


def build_libraries(spec: Path, into: Path) -> Path:
    """A directory with a build's shared libraries (extracted when ``spec`` is a wheel)."""
    spec = spec.expanduser()
    if spec.is_dir() and (spec / "libllama.so").exists():
        return spec
    wheels = sorted(spec.glob("llama_cpp_python-*.whl")) if spec.is_dir() else [spec]
    if not wheels or not wheels[0].is_file():
        raise SystemExit(f"--against {spec}: no llama-cpp-python wheel or directory of its libraries there")
    with zipfile.ZipFile(wheels[0]) as whl:
        members = [m for m in whl.namelist() if m.startswith("llama_cpp/lib/") and not m.endswith("/")]
        if not members:
            raise SystemExit(f"--against {wheels[0]}: the wheel holds no llama_cpp/lib/ libraries")
        for m in members:
            (into / Path(m).name).write_bytes(whl.read(m))
    return into


def interleaved_costs(target, sizes: list[int], context: int, reps: int) -> tuple[dict, dict]:
    """c(n) in ms (median over ``reps`` turns through every size, the order reversed every other turn)
    and c(n)/c(1) (median of each turn's ratio)."""
    import torch

    g = torch.Generator().manual_seed(0)
    target.prefill(torch.randint(100, target.vocab_size, (context,), generator=g).tolist(), return_hidden=False)
    for n in sizes:  # warm-up: first decodes of a size allocate
        target.verify(torch.randint(100, target.vocab_size, (n,), generator=g).tolist(), list(range(-1, n - 1)),
                      return_hidden=False)
        target.commit([])
    ms: dict[int, list[float]] = {n: [] for n in sizes}
    for turn in range(reps):
        for n in (sizes if turn % 2 == 0 else sizes[::-1]):
            tokens = torch.randint(100, target.vocab_size, (n,), generator=g).tolist()
            t0 = time.perf_counter()
            target.verify(tokens, list(range(-1, n - 1)), return_hidden=False)
            target.commit([])
            ms[n].append((time.perf_counter() - t0) * 1e3)
    c_ms = {n: statistics.median(v) for n, v in ms.items()}
    ratio = {n: statistics.median(a / b for a, b in zip(ms[n], ms[sizes[0]])) for n in sizes}
    return c_ms, ratio


def child(args) -> None:
    """One build, one process: the interleaved costs and the bit-for-bit check, as one JSON line."""
    import torch

    from jetflow.models.gguf_meta import gguf_tokenizer
    from jetflow.models.llamacpp_target import LlamaCppTarget, llama_build
    from jetflow.models.resolve import locate_gguf

    gguf, _ = locate_gguf(args.target)
    sizes = [int(n) for n in args.sizes.split(",")]
    target = LlamaCppTarget(gguf, gguf_tokenizer(gguf), n_threads=args.threads)
    c_ms, ratio = interleaved_costs(target, sizes, args.context, args.reps)
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
    print(json.dumps({"build": llama_build(), "c_ms": c_ms, "ratio": ratio, "bit_for_bit": exact}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, help="another llama-cpp-python build: a wheel, a directory with one, "
                                                 "or its lib directory")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15, help="turns through every size in one process")
    ap.add_argument("--rounds", type=int, default=4, help="processes per build, the order alternating")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    if args.against is None:
        ap.error("--against is required: the build to compare the installed one with")
    if not args.sizes.startswith("1,"):
        ap.error("--sizes must start with 1: every cost is also given relative to a one-token decode")
    if args.out is not None:
        from jetflow.utils.fs import check_writable_file

        check_writable_file(args.out)

    with tempfile.TemporaryDirectory() as tmp:
        libs = {"installed": None, "against": build_libraries(args.against, Path(tmp))}
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
        summary[name] = {"build": rows[0]["build"],
                         "c_ms_median_of_rounds": {n: statistics.median(row["c_ms"][n] for row in rows) for n in sizes},
                         "ratio_to_one_token": {n: statistics.median(row["ratio"][n] for row in rows) for n in sizes},
                         "bit_for_bit": all(all(row["bit_for_bit"].values()) for row in rows)}
    ins, ag = summary["installed"], summary["against"]
    summary["installed_over_against"] = {n: ins["c_ms_median_of_rounds"][n] / ag["c_ms_median_of_rounds"][n]
                                         for n in sizes}
    print(f"{'n':>4s} {'against ms':>11s} {'installed ms':>13s} {'ratio':>6s} {'against c(n)/c(1)':>18s} "
          f"{'installed':>10s}")
    for n in sizes:
        print(f"{n:>4s} {ag['c_ms_median_of_rounds'][n]:11.2f} {ins['c_ms_median_of_rounds'][n]:13.2f} "
              f"{summary['installed_over_against'][n]:6.2f} {ag['ratio_to_one_token'][n]:18.2f} "
              f"{ins['ratio_to_one_token'][n]:10.2f}")
    print(f"bit for bit: installed {ins['bit_for_bit']}, against {ag['bit_for_bit']}")
    if args.out is not None:
        from jetflow.eval.machine import machine
        from jetflow.utils.fs import write_json_atomic

        write_json_atomic(args.out, {"command": ["python", "benchmarks/llamacpp_build_vs_build.py", *sys.argv[1:]],
                                     "machine": machine(), "threads": args.threads, "context": args.context,
                                     "reps": args.reps, "rounds": runs, "summary": summary})
    return 0 if ins["bit_for_bit"] and ag["bit_for_bit"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
