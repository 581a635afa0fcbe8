"""Loss curve of a training run (train_log.jsonl -> PNG): training loss per step, held-out loss and
per-depth top-1 agreement at the evaluation steps."""

from __future__ import annotations

import json
from pathlib import Path


def plot_training_log(log_file: str | Path, png: str | Path) -> bool:
    """Write the PNG; False (and nothing written) without matplotlib or without records."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    log_file = Path(log_file)
    if not log_file.is_file():
        return False
    records = []
    for line in log_file.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line a kill cut short (or blank)
            continue
    if not records:
        return False
    evals = [r for r in records if "eval_loss" in r]
    fig, (ax_loss, ax_agree) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in records], [r["loss"] for r in records], lw=0.8, label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out")
        last = evals[-1]["top1_agreement"]
        for depth in sorted({0, len(last) // 2, len(last) - 1}):
            ax_agree.plot([r["step"] for r in evals], [r["top1_agreement"][depth] for r in evals], "o-",
                          label=f"depth {depth + 1}")
        ax_agree.plot([r["step"] for r in evals], [sum(r["top1_agreement"]) / len(r["top1_agreement"]) for r in evals],
                      "k--", label="mean")
    ax_loss.set(xlabel="step", ylabel="loss", title="distillation loss")
    ax_agree.set(xlabel="step", ylabel="top-1 agreement", title="held-out draft/teacher agreement", ylim=(0, 1))
    ax_loss.legend()
    if evals:
        ax_agree.legend()
    fig.tight_layout()
    tmp = Path(png).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(png)
    return True
