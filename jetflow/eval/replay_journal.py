"""A resumable offline replay: each finished sequence's accepted depths, one JSON line per sequence.

A replay of 50 sequences at budget 256 with the tree-conditioned pass runs for most of an hour on a
2-core CPU. The journal (``<out>.partial.jsonl`` beside the report) records each sequence as it
finishes; a run started again with the same settings reads it back and replays only the sequences
it lacks, so an interrupted replay loses at most the sequence it was on. Its first line holds the
settings: a journal written with other settings is refused, naming the first that differs, and
left as it is. With a lookup calibration carried across sequences (``lookup_session``), each line
also holds the calibration's counts after its sequence, so a resumed session continues from them.
"""

from __future__ import annotations

import json
from pathlib import Path

from jetflow.errors import JetFlowError


def journal_path(out: str | Path) -> Path:
    """Where the journal of a replay whose report goes to ``out`` lives."""
    out = Path(out)
    return out.with_name(out.name + ".partial.jsonl")


def _arm_value(key: str):
    return int(key) if key.lstrip("-").isdigit() else key


class ReplayJournal:
    """Sequences already replayed, per drafter, read back from ``path`` if it exists."""

    def __init__(self, path: str | Path, settings: dict):
        self.path, self.settings = Path(path), json.loads(json.dumps(settings))  # as JSON would give it back
        self._done: dict[str, dict[int, dict]] = {}
        if self.path.exists():
            self._read()

    def _read(self) -> None:
        text = self.path.read_text()
        if text and not text.endswith("\n"):  # a line cut short by the interruption: its sequence is redone
            text = text[:text.rfind("\n") + 1]
            self.path.write_text(text)
        lines = text.splitlines()
        try:
            header = json.loads(lines[0])["settings"] if lines else None
        except (ValueError, KeyError, TypeError):
            header = None
        if not isinstance(header, dict):
            raise JetFlowError(f"{self.path} is not a replay journal (no settings line); move it away or choose "
                               "another --out")
        for key in sorted(set(header) | set(self.settings)):
            if header.get(key) != self.settings.get(key):
                raise JetFlowError(f"{self.path} was written by a replay with other settings ({key}: "
                                   f"{header.get(key)!r}, now {self.settings.get(key)!r}); it is kept as it is: "
                                   "rerun with the same settings to resume it, or choose another --out")
        for number, line in enumerate(lines[1:], 2):
            try:
                entry = json.loads(line)
                self._done.setdefault(entry["drafter"], {})[int(entry["index"])] = entry
            except (ValueError, KeyError, TypeError):
                raise JetFlowError(f"{self.path}, line {number}: not a journal entry; the journal is damaged "
                                   "(move it away to start the replay again)") from None

    def _append(self, obj: dict) -> None:
        if not self.path.exists():  # written with the first sequence: a run refused at the start leaves none
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"settings": self.settings}) + "\n")
        with self.path.open("a") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()

    def done(self, drafter: str) -> int:
        """How many sequences of ``drafter`` are in the journal."""
        return len(self._done.get(drafter, {}))

    def get(self, drafter: str, index: int) -> dict | None:
        """The journal's entry for sequence ``index``: ``depths`` (arm -> accepted depths of its rounds),
        ``seconds``, and ``session`` (arm -> ``LookupCalibration.counts()``) when one was recorded."""
        entry = self._done.get(drafter, {}).get(index)
        if entry is None:
            return None
        session = entry.get("session")
        return {"depths": {_arm_value(k): v for k, v in entry["depths"].items()}, "seconds": entry["seconds"],
                "session": None if session is None else {_arm_value(k): v for k, v in session.items()}}

    def record(self, drafter: str, index: int, depths: dict, seconds: float, session: dict | None = None) -> None:
        entry = {"drafter": drafter, "index": index, "seconds": round(seconds, 3),
                 "depths": {str(arm): list(d) for arm, d in depths.items()}}
        if session is not None:
            entry["session"] = {str(arm): cal.counts() for arm, cal in session.items()}
        self._append(entry)
        self._done.setdefault(drafter, {})[index] = entry
