"""Drafters that ship inside the package (bf16 checkpoints trained with ``jetflow train``).

``jetflow/drafters/<target short name>/`` holds ``config.json``, ``model.safetensors`` and a model
card; ``drafter="auto"`` picks the one made for the loaded target, if any.
"""

from __future__ import annotations

from pathlib import Path

DRAFTERS_DIR = Path(__file__).resolve().parent.parent / "drafters"


def shipped_drafter(target_name: str, variant: str = "") -> Path | None:
    """The drafter shipped for the target named ``target_name`` (any name of a known model: its short
    name, hub id, a local copy's directory name, the packaged GGUF's stem), None when none ships;
    ``variant``: "dflash" for the DFlash-compatible one."""
    from jetflow.models.resolve import known_model_key

    name = known_model_key(target_name) or str(target_name)
    path = DRAFTERS_DIR / (f"{name}-{variant}" if variant else name)
    return path if (path / "config.json").is_file() and (path / "model.safetensors").is_file() else None
