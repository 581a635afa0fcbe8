"""Fit a block head's tree calibration (tree/calibration.py) on sequences the target answered greedily.

Every answer position of the given sequences is an anchor: one head forward per chunk of anchors
(batched as in training), then each depth's top-w candidates under the true path are records. The
sequences must be held out from the head's training, or the fit learns the head's confidence on
data it has memorised; `jetflow calibrate --held-out` takes the training run's own held-out split.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from jetflow.data.shards import Sequence
from jetflow.errors import JetFlowError
from jetflow.eval.offline_acceptance import ReplayRounds
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead
from jetflow.models.draft_vocab import target_to_draft_index
from jetflow.models.target import TargetModel
from jetflow.tree.calibration import TreeCalibration, candidate_records, fit_calibration, reliability
from jetflow.utils.fs import replace_directory


@torch.no_grad()
def calibration_records(head: DraftHead, target: TargetModel, sequences: list[Sequence], teacher,
                        indices: list[int], width: int, chunk: int = 16) -> list[tuple]:
    """:func:`candidate_records` of every answer anchor of ``sequences[i]``, i in ``indices``."""
    head = head.eval()
    lm_weight = head.output_weight(target.lm_head_weight())
    draft_index = None if head.draft_ids is None else target_to_draft_index(head.draft_ids.cpu(), target.vocab_size)
    records = []
    for index in indices:
        seq = sequences[index]
        anchors = list(range(seq.prompt_len, len(seq.token_ids) - 1))  # each with a token after it
        if not anchors:
            continue
        features, _ = teacher.fetch(index, seq, torch.zeros(0, dtype=torch.long))
        rounds = ReplayRounds(head, target.embed, lm_weight, draft_index, features, seq, 1, width, chunk=chunk)
        for i in range(0, len(anchors), chunk):
            part = anchors[i:i + chunk]
            _, logprobs = rounds.first_pass(part)
            top_lp, top_ids = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)
            top_lp, top_ids = top_lp.cpu().numpy(), top_ids.cpu().numpy()
            for k, a in enumerate(part):
                records += candidate_records(top_lp[k], top_ids[k], rounds.ids[a + 1:a + rounds.block])
    return records


def fit_head_calibration(head: DraftHead, target: TargetModel, sequences: list[Sequence], teacher,
                         indices: list[int], width: int) -> tuple[TreeCalibration, list[dict]]:
    """The head's calibration and the reliability table of the records it was fitted on."""
    if head.config.kind != "block":
        raise JetFlowError(f"tree calibration is for block heads; this one is {head.config.kind!r}")
    records = calibration_records(head, target, sequences, teacher, indices, width)
    depths = head.config.block_size - 1
    try:
        return fit_calibration(records, depths), reliability(records, depths)
    except ValueError as e:
        raise JetFlowError(str(e)) from None


def write_calibrated(drafter_dir: str | Path, calibration: TreeCalibration, out: str | Path) -> Path:
    """A copy of checkpoint ``drafter_dir`` at ``out`` whose config.json holds ``calibration``; every
    other file and directory (a clone's ``.git``, a download's ``.cache``) is copied as it is. ``out``
    may be ``drafter_dir`` itself: the new directory replaces it only once complete."""
    src = Path(drafter_dir)
    config = json.loads((src / "config.json").read_text())
    config["tree_calibration"] = calibration.to_json()
    with replace_directory(Path(out), [f.name for f in src.iterdir()]) as tmp:
        for f in src.iterdir():  # (what links point at: a hub snapshot's files are links into its blobs)
            if f.is_dir():
                shutil.copytree(f, tmp / f.name)
            elif f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return Path(out)


def calibrate_drafter(target: TargetModel, drafter_dir: str | Path, data_dir, out: str | Path, *,
                      teacher_cache=None, seq_range: str | None = None, held_out: int | None = None,
                      max_sequences: int | None = None, width: int = 7, log=print) -> dict:
    """Fit ``drafter_dir``'s tree calibration on ``data_dir``'s sequences ``seq_range`` (START:END) or,
    with ``held_out`` = a training seed, on the split `jetflow train` held out with that seed (from its
    first ``max_sequences`` sequences, as the run took them: the split depends on the count); write
    the calibrated checkpoint to ``out``. Returns a report."""
    from jetflow.eval.offline_acceptance import eval_teacher, parse_range
    from jetflow.training.trainer import EVAL_SEQUENCES, data_label, held_out_split, load_sequences

    sequences = load_sequences(data_dir, target, max_sequences if held_out is not None else None)
    if held_out is not None:
        indices = sorted(held_out_split(len(sequences), held_out, EVAL_SEQUENCES)[0])
    else:
        start, end = parse_range(seq_range, len(sequences))
        indices = list(range(start, end))
    if not indices:
        raise JetFlowError(f"{data_label(data_dir)}: no held-out sequences to calibrate on")
    head = load_drafter(drafter_dir, target=target, device=target.device, dtype=torch.float32)
    target.set_tapped_layers(head.config.target_layer_ids)
    teacher = eval_teacher(target, sequences, max(indices) + 1, teacher_cache, head.config.target_layer_ids)
    t0 = time.perf_counter()
    calibration, table = fit_head_calibration(head, target, sequences, teacher, indices, width)
    write_calibrated(drafter_dir, calibration, out)
    log(f"{out}: tree calibration from {calibration.samples} candidates of {len(indices)} sequences "
        f"({time.perf_counter() - t0:.0f} s)")
    return {"drafter": str(drafter_dir), "out": str(out), "data": data_label(data_dir), "sequences": indices,
            "width": width, "samples": calibration.samples, "reliability": table,
            "calibration": calibration.to_json()}
