"""Drafters that ship inside the package (bf16 checkpoints trained with ``jetflow train``).

``jetflow/drafters/<target short name>/`` holds ``config.json``, ``model.safetensors`` and a model
card; ``drafter="auto"`` picks the one made for the loaded target, if any.
"""

from __future__ import annotations

from pathlib import Path

DRAFTERS_DIR = Path(__file__).resolve().parent.parent / "drafters"


def shipped_drafter(target_name: str) -> Path | None:
    path = DRAFTERS_DIR / target_name
    return path if (path / "config.json").is_file() and (path / "model.safetensors").is_file() else None
