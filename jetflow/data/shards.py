"""Token shards of regenerated data: compact ``.npz`` files with the token ids of many sequences.

Each shard holds ``tokens`` (all sequences concatenated; uint16 when the vocabulary fits, else
uint32), ``offsets`` (start of each sequence, plus the end), ``prompt_lens`` (tokens before the
answer: the loss mask is ``position >= prompt_len``) and ``ids`` (prompt ids). Shards are written
to a temporary file and renamed, so a killed job never leaves a half-written shard.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jetflow.errors import JetFlowError
from jetflow.utils.fs import durable_replace


@dataclass
class Sequence:
    prompt_id: str
    token_ids: list[int]  # prompt + answer
    prompt_len: int

    @property
    def answer_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


def shard_path(out_dir: Path, index: int) -> Path:
    return Path(out_dir) / f"shard-{index:05d}.npz"


def write_shard(path: Path, sequences: list[Sequence], vocab_size: int) -> None:
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    tokens = np.concatenate([np.asarray(s.token_ids, dtype=dtype) for s in sequences]) if sequences else np.zeros(0, dtype)
    offsets = np.cumsum([0] + [len(s.token_ids) for s in sequences]).astype(np.int64)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, tokens=tokens, offsets=offsets, prompt_lens=np.asarray([s.prompt_len for s in sequences], np.int32),
             ids=np.asarray(json.dumps([s.prompt_id for s in sequences])))
    durable_replace(tmp, path)


def read_shard(path: Path) -> list[Sequence]:
    try:
        with np.load(path) as z:
            tokens, offsets, prompt_lens = z["tokens"], z["offsets"], z["prompt_lens"]
            ids = json.loads(str(z["ids"]))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:  # (a cut or empty file)
        raise JetFlowError(f"{path} is not a readable token shard: {str(e) or type(e).__name__}") from None
    return [Sequence(ids[i], tokens[offsets[i]:offsets[i + 1]].astype(np.int64).tolist(), int(prompt_lens[i]))
            for i in range(len(prompt_lens))]


REGENERATED = "a `jetflow regenerate` manifest"  # what a data directory's manifest.json is (utils/fs.read_manifest)


def check_distinct(dirs: list[Path]) -> None:
    """JetFlowError when a data directory is given twice (its sequences would count twice)."""
    if len({Path(d).resolve() for d in dirs}) < len(dirs):
        raise JetFlowError(f"a data directory is given twice: {', '.join(map(str, dirs))}")


def list_shards(data_dir: Path) -> list[Path]:
    return sorted(Path(data_dir).glob("shard-[0-9][0-9][0-9][0-9][0-9].npz"))
