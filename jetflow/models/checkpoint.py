"""Drafter checkpoints of any head kind: the one place a config's ``kind`` maps to its head class.

Apart from draft_head.py because it needs every head class, and the EAGLE head is built on the
block head: draft_head.py importing eagle_head.py would be an import cycle.
"""

from __future__ import annotations

from pathlib import Path

import torch

from jetflow.models.draft_head import DraftHead, DraftHeadConfig, read_config
from jetflow.models.eagle_head import EagleHead
from jetflow.utils.fs import file_digest

HEAD_CLASSES: dict[str, type[DraftHead]] = {cls.kind: cls for cls in (DraftHead, EagleHead)}


def new_head(config: DraftHeadConfig) -> DraftHead:
    """A freshly initialised head of the class ``config.kind`` names."""
    return HEAD_CLASSES[config.kind](config)


def load_drafter(path: str | Path, target=None, device=None, dtype: torch.dtype | None = None) -> DraftHead:
    """Load a drafter checkpoint dir of any kind (a block head, or an EAGLE-3-style head as
    :class:`EagleHead`); with ``target``, refuse one built for a different target."""
    path = Path(path).expanduser()
    config = read_config(path)
    return HEAD_CLASSES[config.kind].load(path, config, target, device, dtype)


def head_fingerprint(path) -> str:
    """The digests of a drafter checkpoint's files: results or a journal made with other weights
    (a checkpoint retrained or calibrated in place) are not taken for this one's."""
    return "-".join(file_digest(f) for f in (Path(path) / "config.json", Path(path) / "model.safetensors")
                    if f.is_file())
