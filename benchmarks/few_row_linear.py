"""x @ W^T against W @ x^T on this CPU: each linear shape of the target at a few row counts (one row
also as two, the "paired" form), then a whole tree verify of the target in each form of
models/few_row_linear.py (one copy of the model per form, measured alternately). The shapes alone
run from the cache; "streamed" runs all of the model's products in a row, its weights coming from
memory as in a forward.

    python benchmarks/few_row_linear.py --out docs/results/few_row_linear/probe.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from jetflow.eval.machine import machine
from jetflow.models.few_row_linear import ENV, LAYERS, few_row_linear, transposed_linear
from jetflow.utils.fs import write_json_atomic
from jetflow.utils.timing import median_ms

ROWS = (1, 2, 4, 17, 65, 257)
VERIFY = (1, 2, 3, 5, 9, 17, 33, 65, 257)


def load(form: str, spec: str):
    from jetflow.models.loading import load_target

    os.environ[ENV] = form
    target = load_target(spec, backend="torch")
    assert target.linear_form == form
    return target


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=150, help="committed tokens before each verify")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    targets = {form: load(form, args.target) for form in LAYERS}
    model = targets["standard"].model

    shapes = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            shapes.setdefault(tuple(m.weight.shape), (name.split(".")[-1], m.weight))
    kernels = []
    print("ms per product, x @ W^T / W @ x^T (one row: / as two)")
    print(f"{'layer':12s} {'shape':>12s} " + " ".join(f"{'rows ' + str(r):>18s}" for r in ROWS))
    for shape, (name, w) in shapes.items():
        row = {"layer": name, "shape": list(shape), "standard_ms": {}, "transposed_ms": {}, "paired_ms": {}}
        for rows in ROWS:
            x = torch.randn(rows, shape[1], dtype=w.dtype)
            reps = max(3, args.reps if w.numel() < 10**7 else args.reps // 2)
            row["standard_ms"][rows] = median_ms(lambda: F.linear(x, w), reps)
            row["transposed_ms"][rows] = median_ms(lambda: transposed_linear(x, w, None), reps)
            if rows == 1:
                row["paired_ms"][rows] = median_ms(lambda: few_row_linear(x, w, True, paired=True), reps)
        kernels.append(row)
        print(f"{name:12s} {str(shape):>12s} " + " ".join(
            f"{row['standard_ms'][r]:6.2f}/{row['transposed_ms'][r]:.2f}" + (f"/{row['paired_ms'][r]:.2f}" if r == 1 else "")
            for r in ROWS))

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    products = {"x @ W^T": lambda x, w: F.linear(x, w), "W @ x^T": lambda x, w: transposed_linear(x, w, None),
                "one row as two": lambda x, w: few_row_linear(x, w, True, paired=True)}
    inputs = {rows: {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights} for rows in (1, 2, 4)}
    streamed = {}
    for name, product in products.items():
        for rows in ((1,) if name == "one row as two" else (1, 2, 4)):
            streamed[f"{name}, {rows} row(s)"] = median_ms(
                lambda: [product(inputs[rows][w.shape[1]], w) for w in weights], args.reps)
    print(f"streamed: all {len(weights)} products of the model, ms (median of {args.reps})")
    for name, ms in streamed.items():
        print(f"  {name:24s} {ms:7.1f}")

    prefix = list(range(1000, 1000 + args.context))
    verify = {form: {} for form in targets}
    for n in VERIFY:
        tokens, parents = list(range(500, 500 + n)), list(range(-1, n - 1))  # a chain: n rows
        samples = {form: [] for form in targets}
        for form, target in targets.items():
            target.prefill(prefix)
            target.verify(tokens, parents)  # warm
        for _ in range(args.reps):  # alternate the forms, so drift falls on all
            for form, target in targets.items():
                start = time.perf_counter()
                target.verify(tokens, parents)
                samples[form].append(1e3 * (time.perf_counter() - start))
        for form in targets:
            verify[form][n] = statistics.median(samples[form])
    c1 = verify["standard"][1]
    print("verify of n rows, ms (ratio to one row of x @ W^T):")
    for n in VERIFY:
        print(f"  n={n:4d}  " + "   ".join(f"{form} {verify[form][n]:7.1f} ({verify[form][n] / c1:.2f})" for form in targets))
    if args.out:
        write_json_atomic(args.out, {"machine": machine(), "threads": torch.get_num_threads(),
                                     "context": args.context, "kernels": kernels, "streamed_ms": streamed,
                                     "verify_ms": verify})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
