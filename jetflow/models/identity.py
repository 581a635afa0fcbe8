"""The part of a target's ``identity()`` that names the model rather than the runtime running it.

Regenerated data and teacher caches are made by the model, whatever runtime and dtype ran it (a
run resumes, and training reads them, on any of these), and records written before the runtime
keys existed lack them; so these records hold and compare only this part. Drafter checkpoints keep
the whole identity but are checked on sizes only (``draft_head.check_compatible``).
"""

from __future__ import annotations

RUNTIME_KEYS = ("backend", "dtype")


def model_identity(target) -> dict:
    """``target.identity()`` without the runtime keys."""
    return {k: v for k, v in target.identity().items() if k not in RUNTIME_KEYS}
