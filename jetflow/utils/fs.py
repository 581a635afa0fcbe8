"""Filesystem helpers: the cache location, atomic directory writes and atomic JSON files."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

from jetflow.errors import JetFlowError


def cache_root() -> Path:
    """JetFlow's cache directory: ``$JETFLOW_CACHE`` or ``~/.cache/jetflow``."""
    return Path(os.environ.get("JETFLOW_CACHE") or Path.home() / ".cache" / "jetflow").expanduser()


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory that is renamed to ``final`` only if the block succeeds.

    A crash or kill inside the block leaves at most a ``.tmp-*`` directory behind, never a
    half-written ``final``. If ``final`` appears meanwhile (another process won the race), the
    existing one is kept and the new copy is discarded.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        _umask_modes(tmp)  # mkdtemp (and mkstemp inside) make them owner-only: another user's server could not read it
        fsync_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
        fsync_directory(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def replace_directory(final: Path, replaceable: Collection[str] | None = None) -> Iterator[Path]:
    """Like :func:`atomic_directory`, but a completed block replaces an existing ``final`` (for
    checkpoints that are rewritten as training goes on). The old copy is removed only after the new
    one is in place. ``replaceable``: the only entries an existing ``final`` may hold (what the
    writer writes): a directory holding anything else, or a file, is refused (JetFlowError) before
    the block runs, so a mistyped ``--out`` never deletes a user's files."""
    final = Path(final).resolve()  # (so that "." has a name to stage next to)
    recover_directory(final)
    if replaceable is not None:
        check_replaceable(final, replaceable)
    staged, old = _swap_names(final)
    with atomic_directory(staged) as tmp:
        yield tmp
    if final.exists():
        final.rename(old)
    staged.rename(final)
    fsync_directory(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_directory(final: Path) -> None:
    """Finish a :func:`replace_directory` that a kill interrupted: a staged copy is always complete
    (it is renamed into place only once written), and newer than ``final``, so it is put in place; a
    leftover replaced copy is removed (both under names of their own, :func:`_swap_names`). Readers of a replaced
    directory (a training run's resume) call this first."""
    final = Path(final).resolve()
    staged, old = _swap_names(final)
    if staged.is_dir():
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        staged.rename(final)
    if old.exists():
        shutil.rmtree(old)


def _swap_names(final: Path) -> tuple[Path, Path]:
    """The siblings a replace stages the new copy in and moves the old one to: names no user gives a
    directory (a user's ``final.new`` or ``final.old`` backup is never touched)."""
    return final.with_name(f".{final.name}.jetflow-staged"), final.with_name(f".{final.name}.jetflow-replaced")


def check_replaceable(final: Path, replaceable: Collection[str]) -> None:
    """JetFlowError unless ``final`` is missing, or a directory holding only ``replaceable`` entries
    (what :func:`replace_directory` may then replace); run it before a long job that ends in one."""
    final = Path(final)
    if not final.exists():
        return
    if not final.is_dir():
        raise JetFlowError(f"{final} is a file, not a directory")
    other = sorted(e.name for e in final.iterdir() if e.name not in replaceable)
    if other:
        raise JetFlowError(f"{final} holds other files ({', '.join(other[:4])}{', ...' if len(other) > 4 else ''}); "
                           "refusing to replace it: choose a new or empty directory")


def read_manifest(directory: Path, what: str) -> dict | None:
    """``directory/manifest.json`` (None when there is none); JetFlowError when it is not a JSON
    object (``what``: what the manifest should be, for the message)."""
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JetFlowError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise JetFlowError(f"{path} is not {what} (a JSON {type(manifest).__name__}, not an object)")
    return manifest


def file_digest(path: Path) -> str:
    """A short sha256 of a file's bytes (cache keys, checkpoint identity)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def write_json_atomic(path: Path, obj: dict, durable: bool = True) -> None:
    """Write a JSON file so readers see the old or the new content, never a torn one."""
    write_text_atomic(path, json.dumps(obj, indent=2), durable)


def write_text_atomic(path: Path, text: str, durable: bool = True) -> None:
    """Write a text file so readers see the old or the new content, never a torn one (staged in a
    temporary file of its own, so no file of the user's is overwritten on the way). A path that
    cannot be written raises OSError and leaves no partial or staging file behind. ``durable``:
    on disk before it replaces the old content (off for state a reader may drop when damaged)."""
    with atomic_path(Path(path), durable) as tmp:
        tmp.write_text(text)


def check_writable_file(path: Path) -> None:
    """JetFlowError when a file could not be written at ``path``: a directory is there, or its
    directory cannot be made or written in (see :func:`check_writable_dir`). Run it before a long
    job that ends in writing one."""
    path = Path(path)
    if path.is_dir():
        raise JetFlowError(f"{path} is a directory, not a file")
    check_writable_dir(path.parent, what=str(path), keep=False)


def check_writable_dir(directory: Path, what: str | None = None, keep: bool = True) -> None:
    """JetFlowError naming ``what`` (default: the directory) unless ``directory`` exists or can be
    made and a file can be created in it. It is tried for real (made, and a file created and
    removed): permission bits do not tell, e.g. for root under /proc or on a read-only mount. The
    directories it made stay unless ``keep`` is False (a check before a job that may fail first)."""
    directory, what = Path(directory), what or str(directory)
    chain = [directory.absolute(), *directory.absolute().parents]
    blocker = next((p for p in chain if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise JetFlowError(f"{what} cannot be written: {blocker} is a file")
    made = chain[chain.index(blocker) - 1] if blocker is not None and blocker != chain[0] else None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise JetFlowError(f"{what} cannot be written: {e.strerror or e} ({e.filename or directory})") from None
    finally:
        if made is not None and not keep:
            shutil.rmtree(made, ignore_errors=True)  # only the empty directories made here


def _umask_modes(root: Path) -> None:
    """Give ``root`` and everything under it the modes a plain mkdir / open would (the umask's)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def atomic_path(final: Path, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling file path that replaces ``final`` only if the block succeeds, so an
    existing ``final`` survives a failed or interrupted write."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".tmp-{final.name}-", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it owner-only
        durable_replace(tmp, final) if durable else os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def durable_replace(src: Path, dst: Path) -> None:
    """``os.replace(src, dst)`` once ``src``'s bytes are on disk, and the rename too: without the
    fsyncs a power loss soon after can leave ``dst`` renamed but empty (ext4, xfs), which a resume
    would then take for finished work."""
    fsync_file(src)
    os.replace(src, dst)
    fsync_directory(Path(dst).parent)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)  # (Windows flushes only what it may write)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (a directory about to be renamed into place)."""
    for path in sorted(Path(root).rglob("*"), key=lambda p: -len(p.parts)):
        if path.is_symlink():
            continue
        fsync_directory(path) if path.is_dir() else fsync_file(path)
    fsync_directory(root)


def fsync_directory(path: Path) -> None:
    """fsync a directory's entries (a rename in it); a no-op where directories cannot be opened or
    synced (Windows, some network filesystems), which have no other way to ask for it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
