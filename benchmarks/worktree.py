"""Earlier commits of this repository checked out beside it, for the before/after benchmarks
(lean_draft_ab.py, tau_ab.py)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev: str) -> str:
    """The full commit hash of ``rev``."""
    return _git("rev-parse", rev)


def this_checkout() -> str:
    """This checkout's commit, with "+uncommitted" when the package has changes not committed."""
    return resolve("HEAD") + ("+uncommitted" if _git("status", "--porcelain", "jetflow") else "")


@contextmanager
def checkout(commit: str) -> Iterator[Path]:
    """A temporary git worktree of ``commit``, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        _git("worktree", "add", "--detach", str(tree), commit)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False,
                           capture_output=True)
