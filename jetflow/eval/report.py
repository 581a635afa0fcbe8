"""Markdown tables and PNG plots of a benchmark's runs."""

from __future__ import annotations

from pathlib import Path

from jetflow.decoding.costs import speedup_bound
from jetflow.eval.methods import METHODS


def _budget_cell(run: dict) -> str:
    return "-" if run["budget"] is None else str(run["budget"])


def _chain_budget(run: dict, block_sizes: dict[str, int]) -> int | None:
    """Draft nodes a run verifies per round: its budget, or its own head's block size - 1 for the
    chain methods (``block_sizes``: per head kind; the baseline's block may differ from JetFlow's)."""
    if run["budget"] is not None:
        return run["budget"]
    block = block_sizes.get(METHODS[run["method"]].head) if run["method"] in ("dflash", "jetflow-chain") else None
    return block - 1 if block else None


def best_runs(runs: list[dict]) -> dict[tuple[str, str], dict]:
    """The fastest run (by total speed-up) of each (dataset, method)."""
    best: dict[tuple[str, str], dict] = {}
    for run in runs:
        k = (run["dataset"], run["method"])
        if k not in best or run["summary"].get("speedup", 0) > best[k]["summary"].get("speedup", 0):
            best[k] = run
    return best


RUN_TABLE_HEAD = ["| dataset | method | budget | tau | tok/s | speed-up | 95% interval | per-prompt | identical to reference |",
                  "|---|---|---|---|---|---|---|---|---|"]  # the columns of _row


def markdown(runs: list[dict], machine: dict, settings: dict, costs: dict | None = None,
             block_sizes: dict[str, int] | None = None) -> str:
    lines = ["# JetFlow benchmark", "",
             f"Machine: {machine.get('cpu', '?')} ({', '.join(machine.get('cpu_flags') or ['flags unknown'])}), "
             f"{machine.get('threads', '?')} threads, torch "
             f"{machine.get('torch', '?')}, device {machine.get('device', '?')}.  ",
             f"Target {settings['target']}; {settings['max_new_tokens']} new tokens, temperature "
             f"{settings['temperature']}, width {settings['width']}, {settings['repeats']} timed run(s) per prompt "
             f"(median).", "",
             "tau = mean accepted length per round, bonus token included (tokens a last round accepted past a "
             "stop or the length limit count; `tokens_per_round` in summary.json leaves them out; for `hf`/`pld` "
             "tokens per target forward). Speed-up = total tokens / "
             "total time against the reference (`ar`, or `llama-ar` in a greedy run on llama.cpp; headline), with its 95% interval "
             "from resampling prompts (a paired bootstrap); per-prompt = mean of per-prompt speed-ups.", "",
             "## Best budget per method", "", *RUN_TABLE_HEAD]
    for (dataset, method), run in sorted(best_runs(runs).items(), key=lambda kv: (kv[0][0], _order(kv[0][1]))):
        lines.append(_row(run, dataset, method))
    lines += ["", "## All runs", "", *RUN_TABLE_HEAD]
    for run in runs:
        lines.append(_row(run, run["dataset"], run["method"]))
    categorized = [r for r in runs if r["summary"].get("by_category")]
    if categorized:
        lines += ["", "## Per category", "",
                  "| dataset | method | budget | category | prompts | tau | tok/s | speed-up | identical to reference |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for run in sorted(categorized, key=lambda r: (r["dataset"], _order(r["method"]), str(r["budget"]))):
            for cat, s in run["summary"]["by_category"].items():
                lines.append(f"| {run['dataset']} | {run['method']} | {_budget_cell(run)} | {cat} | {s['prompts']} | "
                             f"{s['tau']:.2f} | {s['tokens_per_s']:.1f} | {s.get('speedup', 1):.2f}x | {_same(s)} |")
    splits = [r for r in runs if r["summary"].get("ms_per_round")]
    if splits:
        phases = list(splits[0]["summary"]["ms_per_round"])
        lines += ["", "## Time per round (ms)", "", "| dataset | method | budget | " + " | ".join(phases) + " |",
                  "|---|---|---|" + "---|" * len(phases)]
        for run in splits:
            ms = run["summary"]["ms_per_round"]
            lines.append(f"| {run['dataset']} | {run['method']} | {_budget_cell(run)} | "
                         + " | ".join(f"{ms[p]:.1f}" for p in phases) + " |")
    if costs:
        lines += ["", "## Cost model", "",
                  f"Target forward over one token after {costs['context']} tokens (the mean context of the ar "
                  f"runs): c(1) = {costs['c1_ms']:.1f} ms. "
                  "bound = tau * c(1) / (c_draft + c(n+1)) with this run's tau: the speed-up if a round cost only "
                  "its draft and verify forwards.", "",
                  "Verify cost curve of the target's backend, c(n+1)/c(1) for n draft nodes: "
                  + ", ".join(f"{n}: {r:.2f}" for n, r in sorted(costs["verify_ratio"].items())), "",
                  "| dataset | method | budget n | c(n+1)/c(1) | draft ms | verify ms | bound | measured |",
                  "|---|---|---|---|---|---|---|---|"]
        for run in runs:
            n = _chain_budget(run, block_sizes or {})
            if n is None or n not in costs["verify_ms"]:
                continue
            s = run["summary"]
            draft = costs["draft_ms"].get(METHODS[run["method"]].head, {}).get(n, 0.0)
            bound = speedup_bound(s["tau"], costs, n, draft_ms=draft)
            lines.append(f"| {run['dataset']} | {run['method']} | {n} | {costs['verify_ratio'][n]:.2f} | "
                         f"{draft:.1f} | {costs['verify_ms'][n]:.1f} | {bound:.2f}x | "
                         f"{s.get('speedup', 1):.2f}x |")
    return "\n".join(lines) + "\n"


ORDER = ["llama-ar", "ar", "hf", "pld", "lookup", "torch-ar", "torch-jetflow", "llama-dflash", "dflash", "ddtree",
         "eagle3", "eagle3-lookup", "jetflow-chain", "jetflow", "jetflow-lookup", "jetflow-refine"]


def _order(method: str) -> int:
    return ORDER.index(method) if method in ORDER else len(ORDER)


def _row(run: dict, dataset: str, method: str) -> str:
    s = run["summary"]
    per, ci = s.get("speedup_per_prompt_mean"), s.get("speedup_ci95")
    return (f"| {dataset} | {method} | {_budget_cell(run)} | {s['tau']:.2f} | {s['tokens_per_s']:.1f} | "
            f"{s.get('speedup', 1):.2f}x | {'-' if ci is None else f'{ci[0]:.2f}-{ci[1]:.2f}x'} | "
            f"{'-' if per is None else f'{per:.2f}x'} | {_same(s)} |")


def _same(s: dict) -> str:
    """The 'identical to reference' cell of a summary."""
    return "-" if "mismatches" not in s else ("yes" if not s["mismatches"] else f"**NO ({len(s['mismatches'])})**")


def plots(runs: list[dict], out_dir: Path) -> list[Path]:
    """tau_vs_budget.png and speedup_vs_budget.png: one panel per dataset, one line per tree method,
    budget-free methods as horizontal lines. Returns the files written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    datasets = list(dict.fromkeys(r["dataset"] for r in runs))
    written = []
    for metric, label, fname in (("tau", "tau (tokens per round)", "tau_vs_budget.png"),
                                 ("speedup", "speed-up vs ar", "speedup_vs_budget.png")):
        fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.8), squeeze=False)
        for ax, dataset in zip(axes[0], datasets):
            mine = [r for r in runs if r["dataset"] == dataset]
            budgets = sorted({r["budget"] for r in mine if isinstance(r["budget"], int)})
            for run in (r for r in mine if r["budget"] == "auto"):  # a level, like the budget-free methods
                ax.axhline(run["summary"].get(metric, 1.0), ls=":", lw=1.5, color=f"C{_order(run['method'])}",
                           label=f"{run['method']} auto")
            for method in sorted({r["method"] for r in mine}, key=_order):
                rs = [r for r in mine if r["method"] == method and r["budget"] != "auto"]
                if not rs:
                    continue
                if rs[0]["budget"] is None:
                    if budgets:
                        ax.axhline(rs[0]["summary"].get(metric, 1.0), ls="--", lw=1, label=method,
                                   color=f"C{_order(method)}")
                    else:
                        ax.plot([0], [rs[0]["summary"].get(metric, 1.0)], "s", label=method, color=f"C{_order(method)}")
                else:
                    rs = sorted(rs, key=lambda r: r["budget"])
                    ax.plot([r["budget"] for r in rs], [r["summary"].get(metric, 1.0) for r in rs], "o-",
                            label=method, color=f"C{_order(method)}")
            if budgets:
                ax.set_xscale("log", base=2)
                ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set(title=dataset, xlabel="budget (draft nodes per round)", ylabel=label)
            ax.grid(alpha=0.3)
        for ax in axes[0]:  # methods differ per dataset (e.g. eagle3 on one set only)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(out_dir) / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
