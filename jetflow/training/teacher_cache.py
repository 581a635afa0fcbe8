"""Offline teacher cache: the target's features and top-k next-token distributions, computed once.

Training with an online teacher runs the frozen target over every sequence at every epoch (and again
for every ablation run). The cache runs it once, in large right-padded batches, and stores per
sequence:

* ``features``: the tapped hidden states of every position, bf16 [L, taps*H]. bf16 rather than fp16
  because of massive activations: SmolLM2's first position reaches ~2.5e4 in one dimension of its
  middle and late layers, and a bigger target easily passes fp16's 65504.
* the teacher at the answer positions ``prompt_len .. L-2`` (the only ones a training slot asks for):
  its top-k token ids and log-probabilities; the remaining mass is implied (1 - sum of top-k).

A cache directory holds ``manifest.json`` plus ``part-NNNNN.safetensors`` files of
``sequences_per_part`` sequences each, written atomically one by one, so a killed build resumes.
Every part records a digest of its sequences' tokens: a cache is only used with the very sequences
(in the same order) it was built from.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from jetflow.data.shards import Sequence
from jetflow.errors import JetFlowError
from jetflow.models.identity import identity_conflict, model_identity, settings_conflict
from jetflow.models.target import TargetModel
from jetflow.utils.fs import durable_replace, read_manifest, write_json_atomic

FORMAT = "jetflow-teacher-cache/1"
TEACHER_CACHE = "a `jetflow cache-teacher` manifest"


def tokens_digest(sequences: list[Sequence]) -> str:
    h = hashlib.sha1()
    for s in sequences:
        h.update(np.asarray([s.prompt_len, *s.token_ids], dtype=np.int64).tobytes())
    return h.hexdigest()


def _part_path(out: Path, index: int) -> Path:
    return out / f"part-{index:05d}.safetensors"


@torch.inference_mode()
def _teacher_for_batch(target: TargetModel, batch: list[Sequence], top_k: int, chunk: int = 1024):
    """Features [L_i, taps*H] and (top-k ids, log-probs) [L_i-1-prompt_len_i, k] per sequence."""
    width = max(len(s.token_ids) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, :len(s.token_ids)] = torch.tensor(s.token_ids)
    taps, hidden = target.features_and_hidden(ids)
    rows = torch.cat([torch.full((len(s.token_ids) - 1 - s.prompt_len,), i) for i, s in enumerate(batch)])
    cols = torch.cat([torch.arange(s.prompt_len, len(s.token_ids) - 1) for s in batch])
    top_ids, top_lp = [], []
    for start in range(0, rows.numel(), chunk):  # the LM head in chunks bounds the [n, V] logits
        sel = hidden[rows[start:start + chunk], cols[start:start + chunk]]
        lp, ix = target.logits(sel).log_softmax(-1).topk(top_k, dim=-1)
        top_ids.append(ix.int().cpu())
        top_lp.append(lp.cpu())
    top_ids, top_lp = torch.cat(top_ids), torch.cat(top_lp)
    out, at = [], 0
    for row, s in enumerate(batch):
        n = len(s.token_ids) - 1 - s.prompt_len
        out.append((taps[row, :len(s.token_ids)].to(torch.bfloat16).cpu(), top_ids[at:at + n], top_lp[at:at + n]))
        at += n
    return out


def build_teacher_cache(target: TargetModel, sequences: list[Sequence], out_dir: str | Path, *, top_k: int = 32,
                        sequences_per_part: int = 256, batch_tokens: int = 4096, source: str = "",
                        progress: bool = True) -> dict:
    """Write (or complete) a teacher cache for ``sequences``; returns the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not 1 <= top_k <= target.vocab_size:
        raise JetFlowError(f"top_k must be in [1, {target.vocab_size}], got {top_k}")
    parts = [sequences[i:i + sequences_per_part] for i in range(0, len(sequences), sequences_per_part)]
    settings = {"format": FORMAT, "target": model_identity(target), "tapped_layers": list(target.tapped_layers),
                "top_k": top_k, "sequences_per_part": sequences_per_part, "source": source}
    manifest_path = out / "manifest.json"
    manifest = {**settings, "parts": {}, "wall_seconds": 0.0}
    old = read_manifest(out, TEACHER_CACHE)
    if old is not None:
        conflict = settings_conflict(old, {k: v for k, v in settings.items() if k != "source"})
        if conflict is not None:
            raise JetFlowError(f"{out} holds a teacher cache with other settings ({conflict}); "
                               "use a new output directory")
        # A cache may be completed or extended (more data directories: a partial last part grows),
        # never rebuilt for other data.
        other = [index for index, part in enumerate(parts)
                 if (done := old.get("parts", {}).get(_part_path(out, index).name)) is not None
                 and done.get("digest") != tokens_digest(part[:done.get("sequences", len(part))])]
        if other:
            raise JetFlowError(f"{out} holds a teacher cache for other sequences ({old.get('source') or 'other data'}; "
                               f"{len(other)} part(s) differ); use a new output directory")
        manifest["parts"] = old.get("parts", {})
        manifest["wall_seconds"] = old.get("wall_seconds", 0.0)
    bar = tqdm(total=sum(len(s.token_ids) for s in sequences), desc="teacher cache", unit="tok", unit_scale=True,
               disable=not progress)
    for index, part in enumerate(parts):
        path, digest = _part_path(out, index), tokens_digest(part)
        if path.exists() and manifest["parts"].get(path.name, {}).get("digest") == digest:
            bar.update(sum(len(s.token_ids) for s in part))
            continue
        t0 = time.perf_counter()
        order = sorted(range(len(part)), key=lambda i: len(part[i].token_ids))  # little padding per batch
        results: dict[int, tuple] = {}
        batch: list[int] = []
        for i in order + [None]:
            if i is not None and (not batch or (len(batch) + 1) * len(part[i].token_ids) <= batch_tokens):
                batch.append(i)
                continue
            for j, r in zip(batch, _teacher_for_batch(target, [part[j] for j in batch], top_k)):
                results[j] = r
            bar.update(sum(len(part[j].token_ids) for j in batch))
            batch = [i] if i is not None else []
        feats, ids, lps = zip(*(results[i] for i in range(len(part))))
        tensors = {
            "features": torch.cat(feats),
            "offsets": torch.tensor(np.cumsum([0] + [f.shape[0] for f in feats])),
            "topk_ids": torch.cat(ids),
            "topk_logprobs": torch.cat(lps).half(),
            "teacher_offsets": torch.tensor(np.cumsum([0] + [x.shape[0] for x in ids])),
        }
        tmp = path.with_suffix(".tmp")
        save_file(tensors, tmp, metadata={"format": FORMAT, "digest": digest})
        durable_replace(tmp, path)
        seconds = time.perf_counter() - t0
        manifest["parts"][path.name] = {"sequences": len(part), "digest": digest, "tokens": int(tensors["offsets"][-1]),
                                        "seconds": seconds, "dtype": target.identity()["dtype"]}
        manifest["wall_seconds"] += seconds
        write_json_atomic(manifest_path, manifest)
    bar.close()
    manifest["complete"] = all(_part_path(out, i).name in manifest["parts"] for i in range(len(parts)))
    manifest["num_sequences"] = len(sequences)
    write_json_atomic(manifest_path, manifest)
    return manifest



class TeacherCache:
    """Random access to a built cache, checked against the sequences it is used with."""

    def __init__(self, cache_dir: str | Path, sequences: list[Sequence], target: TargetModel,
                 tapped_layers: list[int]):
        self.dir = Path(cache_dir)
        m = self.read_manifest(self.dir)
        conflict = identity_conflict(m["target"], model_identity(target))
        if conflict is not None:
            raise JetFlowError(f"teacher cache {self.dir} was built with another target than {target.name!r} "
                               f"({conflict}); build one with this target")
        if list(m["tapped_layers"]) != list(tapped_layers):
            raise JetFlowError(f"teacher cache {self.dir} holds layers {m['tapped_layers']}, the head reads "
                               f"{list(tapped_layers)}")
        self.top_k, per = m["top_k"], m["sequences_per_part"]
        self.per_part = per
        self.files = []
        for index in range(0, (len(sequences) + per - 1) // per):
            part = sequences[index * per:(index + 1) * per]
            entry = m["parts"].get(_part_path(self.dir, index).name)
            if entry is not None and entry["sequences"] > len(part):
                raise JetFlowError(f"teacher cache {self.dir} stores {per} sequences per part: a subset of the "
                                   f"data must hold a multiple of {per} sequences, got {len(sequences)}")
            if entry is None or entry["digest"] != tokens_digest(part):
                raise JetFlowError(f"teacher cache {self.dir} does not cover these sequences (part {index} is "
                                   f"missing or was built from other data); run `jetflow cache-teacher` again")
            handle = safe_open(str(_part_path(self.dir, index)), framework="pt")
            self.files.append((handle, handle.get_tensor("offsets"), handle.get_tensor("teacher_offsets")))

    @staticmethod
    def read_manifest(cache_dir: str | Path) -> dict:
        m = read_manifest(cache_dir, TEACHER_CACHE)
        if m is None:
            raise JetFlowError(f"{cache_dir} has no manifest.json: not a `jetflow cache-teacher` output")
        if m.get("format") != FORMAT:
            raise JetFlowError(f"{cache_dir} is not a teacher cache of format {FORMAT}")
        return m

    def fetch(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features [L, taps*H] (bf16), top-k ids [n, k] and log-probs [n, k] of sequence ``index``;
        teacher row r is the target's distribution at position prompt_len + r."""
        handle, offsets, t_offsets = self.files[index // self.per_part]
        i = index % self.per_part
        a, b = int(offsets[i]), int(offsets[i + 1])
        ta, tb = int(t_offsets[i]), int(t_offsets[i + 1])
        return (handle.get_slice("features")[a:b], handle.get_slice("topk_ids")[ta:tb],
                handle.get_slice("topk_logprobs")[ta:tb])
