"""``jetflow bench`` end to end: the heads its methods need, every run (eval/harness.py), the cost
model, and the written summary (summary.json, summary.md, plots)."""

from __future__ import annotations

import sys
from pathlib import Path

from jetflow.decoding.costs import measure_costs
from jetflow.errors import JetFlowError
from jetflow.eval.datasets import EvalPrompt
from jetflow.eval.harness import BenchSettings, report_mismatches, run_benchmark, typical_context
from jetflow.eval.machine import machine
from jetflow.decoding.sampling import SamplingParams
from jetflow.eval.methods import MethodRunner, MethodSpec, check_sampling
from jetflow.eval.report import markdown, plots
from jetflow.models.checkpoint import head_fingerprint, load_drafter
from jetflow.models.shipped import shipped_drafter
from jetflow.models.backend import TargetBackend
from jetflow.utils.fs import write_json_atomic, write_text_atomic


CURVE_SIZES = {1, 2, 3, 4, 8, 16, 32, 64}  # draft-node counts whose verify cost every report shows


def runtime_settings(target) -> dict:
    """What the target's runtime runs with that changes every method's speed: a stored run is
    reused only under the same (its key holds them)."""
    import torch

    ident = target.identity()
    return {"backend": ident["backend"], "device": str(target.device), "dtype": ident["dtype"],
            "threads": getattr(target, "n_threads", None) or torch.get_num_threads(),
            "flash_attn": bool(getattr(target, "flash_attn", False))}


def run_bench(target: TargetBackend, methods: list[MethodSpec], datasets: dict[str, list[EvalPrompt]],
              budgets: list[int | str], drafters: dict[str, str | None], out: str | Path, *, width: int = 7,
              max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0, limit: int | None = None,
              repeats: int = 1, cost_model: bool = True, interleave: bool = True,
              refine: int | str = 1, int8_draft: bool | None = None, overwrite: bool = False) -> tuple[dict, int]:
    """Run ``methods`` on ``datasets`` at ``budgets`` into ``out`` (runs already there are reused).
    ``drafters``: checkpoint per head kind ("causal" may be "auto": the shipped one); only the kinds
    some method needs are loaded. ``interleave``: time a dataset's runs prompt by prompt (see
    eval/harness.py). Returns the summary line (out dir, run count, plot names) and the
    number of outputs that differ from ar's (each reported on stderr). Runs stored in ``out`` with
    other settings stop it before anything runs, unless ``overwrite``."""
    check_sampling(methods, SamplingParams(temperature).greedy)  # before anything loads or runs
    paths = dict(drafters)
    if paths.get("causal") == "auto":
        paths["causal"] = shipped_drafter(target.name)
    if paths.get("native") == "auto":  # the shipped DFlash-compatible head
        paths["native"] = shipped_drafter(target.name, "dflash")
    native = paths.pop("native", None) if any(m.name == "llama-dflash" for m in methods) else None
    if native is not None and not Path(native).is_dir():
        raise JetFlowError(f"drafter checkpoint directory not found: {native}")
    heads = {}
    for kind, path in paths.items():
        if path is None or not any(m.head == kind for m in methods):
            continue
        if not Path(path).is_dir():
            raise JetFlowError(f"drafter checkpoint directory not found: {path}")
        heads[kind] = load_drafter(path, target=target, device=target.device)
    runner = MethodRunner(target, heads, width=width, native_drafter=native, refine=refine, int8_draft=int8_draft)
    for spec in methods:
        runner.check(spec)
    used = {k: str(v) for k, v in paths.items() if k in heads} | ({"native": str(native)} if native else {})
    settings = BenchSettings(target=target.name, drafters=used, digests={k: head_fingerprint(p) for k, p in used.items()},
                             max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, limit=limit,
                             width=width, repeats=repeats,
                             extra={"runtime": runtime_settings(target)}
                             | ({"refine": refine} if refine != 1 else {})
                             | ({"draft_weights": runner.draft_weights()} if heads else {})
                             | ({"linear_form": target.linear_form}  # verifies timed with few-row products
                                if getattr(target, "linear_form", "standard") != "standard" else {}))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = run_benchmark(runner, methods, datasets, budgets, settings, out, interleave=interleave, overwrite=overwrite)
    costs, blocks = None, {}
    if cost_model:  # verify curve once; draft cost per head (EAGLE's grows with depth)
        drafters_used = {kind: d.drafter for kind, d in runner.decoders.items()}
        blocks = {k: d.block_size for k, d in drafters_used.items() if k != "eagle3"}  # the chain methods' lengths
        sizes = sorted({b for b in budgets if b != "auto"} | {b - 1 for b in blocks.values()} | CURVE_SIZES)
        context = typical_context(runs)
        costs = measure_costs(target, sizes, None, context=context)
        costs["draft_ms"] = {kind: measure_costs(target, sizes, d, context=context, width=width)["draft_ms"]
                             for kind, d in drafters_used.items()}
        for d in drafters_used.values():
            d.reset()
        print(f"verify cost curve on {target.backend}, c(n+1)/c(1) with c(1) = {costs['c1_ms']:.1f} ms: "
              + ", ".join(f"n={n}: {r:.2f}" for n, r in sorted(costs["verify_ratio"].items())), file=sys.stderr)
    info = {"machine": machine(), "settings": settings.key(), "cost_model": costs,
            "runs": [{k: r[k] for k in ("dataset", "method", "budget", "summary")} for r in runs]}
    write_json_atomic(out / "summary.json", info)
    write_text_atomic(out / "summary.md", markdown(runs, info["machine"], settings.key(), costs, blocks))
    written = plots(runs, out)
    summary = {"out": str(out), "runs": len(runs), "plots": [p.name for p in written]}
    return summary, report_mismatches(runs, settings.greedy)
