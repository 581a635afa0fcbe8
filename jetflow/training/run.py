"""A training run as ``jetflow train`` starts it: optional warm start, the data, resume or refuse an
existing run, snapshots at fractions of training, then :meth:`Trainer.fit`."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from jetflow.errors import JetFlowError
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead, read_config
from jetflow.models.target import TargetModel
from jetflow.training.teacher_cache import TeacherCache
from jetflow.training.trainer import TrainConfig, Trainer, load_sequences
from jetflow.utils.fs import _swap_names


def warm_start_head(path: str | Path, target: TargetModel, config: TrainConfig) -> DraftHead:
    """An earlier drafter to start from (the optimizer and schedule start fresh); its shape must be
    the run's, or the run would silently train another head than its arguments say."""
    head = load_drafter(path, target=target, dtype=torch.float32)
    c = head.config
    if c.kind == "block" and config.block_size < c.block_size:
        head = shrink_block(head, config.block_size)
        print(f"--init-from {path}: block {c.block_size} -> {config.block_size} (depth embeddings 0.."
              f"{config.block_size - 1} kept)", file=sys.stderr)
        c = head.config
    if config.shift_tokens and config.path_projection and not (c.shift_tokens or c.path_projection) and c.kind == "block":
        head = add_path_projection(head)
        print(f"--init-from {path}: slots read their parent's token through a new path projection "
              "(zero-initialised)", file=sys.stderr)
        c = head.config
    vocab = c.draft_vocab_size if c.reduced_vocab else 0
    wanted = {"layers": (c.num_hidden_layers, config.layers), "block-size": (c.block_size, config.block_size),
              "attention": (c.attention, config.attention), "draft-vocab": (vocab, config.draft_vocab),
              "feed-last-feature": (c.feed_last_feature, config.feed_last_feature),
              "depth-embedding": (c.depth_embedding, config.depth_embedding), "head": (c.kind, config.head),
              "embed-norm": (c.embed_norm, config.embed_norm),
              "slot-token-gain": (c.slot_token_gain, config.slot_token_gain),
              "shift-tokens": (c.shift_tokens, config.shift_tokens),
              "path-projection": (c.path_projection, config.path_projection)}
    bad = [f"--{k} {want} (checkpoint: {have})" for k, (have, want) in wanted.items() if have != want]
    if bad:
        raise JetFlowError(f"--init-from {path} does not match " + ", ".join(bad))
    # What described the old weights does not describe the new ones: a tree calibration fitted on the
    # old head's log-probs, and a second pass it was trained for (this run trains one only with --reveal).
    head.config.tree_calibration, head.config.path_refine = None, config.reveal > 0
    return head


def add_path_projection(head: DraftHead) -> DraftHead:
    """The same block head with ``shift_tokens`` and a path projection, its other weights kept. The
    projection's linear starts at zero: slot j >= 1 then reads nothing where it read the MASK
    embedding (a constant, small next to the anchor and context inputs every slot gets), so the
    first pass starts close to the old head's and training teaches the projection to read the path."""
    config = dataclasses.replace(head.config, shift_tokens=True, path_projection=True, tree_calibration=None)
    new = type(head)(config).to(head.fc.weight.dtype)
    missing, unexpected = new.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("path_proj.") for k in missing), (missing, unexpected)
    with torch.no_grad():
        new.path_proj[-1].weight.zero_()
    return new


def shrink_block(head: DraftHead, block_size: int) -> DraftHead:
    """The same block head drafting fewer depths: every weight but the depth embedding is shared by
    all slots (positions are rotary), so a smaller block keeps the first ``block_size`` of those. A
    causal head then drafts exactly the big head's first depths; a bidirectional one only starts near them."""
    config = dataclasses.replace(head.config, block_size=block_size)
    state = head.state_dict()
    if head.depth_embed is not None:
        state["depth_embed.weight"] = state["depth_embed.weight"][:block_size]
    small = type(head)(config).to(head.fc.weight.dtype)
    small.load_state_dict(state)
    return small


def head_target_layers(out: str | Path, *, target_layers: list[int] | None = None,
                       init_from: str | Path | None = None, teacher_cache: str | Path | None = None,
                       resume: bool = False) -> tuple[str, list[int]] | None:
    """(where they come from, the target layers the run's head reads), from files alone, so that a
    conflict is refused before the target loads: a trained head's own (the run ``resume`` continues,
    or ``init_from``), else ``target_layers``, else the teacher cache's (a cache holds the features
    of one set of layers: a new head trained on it can only read those). None: the target's default.
    Every source given must agree: a trained head's weights read its own layers, and a cache
    serves only the layers it holds."""
    sources = []  # (name, verb, layers)
    if resume and (Path(out) / "trainer_state").exists():
        drafter = Path(out) / "drafter"  # (or its staged copy, a save cut short: a run's layers never change)
        saved = next((d for d in (drafter, *_swap_names(drafter)) if (d / "config.json").is_file()), None)
        if saved is not None:
            sources.append((f"the run in {out} (--resume)", "reads", read_config(saved).target_layer_ids))
    if init_from:
        sources.append((f"--init-from {init_from}", "reads", read_config(Path(init_from).expanduser()).target_layer_ids))
    if target_layers:
        sources.append(("--target-layers", "asks for", target_layers))
    if teacher_cache:
        cached = TeacherCache.read_manifest(teacher_cache)["tapped_layers"]
        sources.append((f"--teacher-cache {teacher_cache}", "holds", cached))
    if not sources:
        return None
    first, verb, layers = sources[0]
    for other, other_verb, theirs in sources[1:]:
        if sorted(theirs) != sorted(layers):
            raise JetFlowError(f"{first} {verb} target layers {list(layers)} but {other} {other_verb} "
                               f"{list(theirs)}: {_layers_hint(first, other, layers)}")
    # The same layers in another order agree: --target-layers is sorted for the user, while a trained
    # head's features, or a cache's, are in the order it holds them (from before ids were sorted).
    fixed = next((layers for name, _, layers in sources if name != "--target-layers"), layers)
    return first, list(fixed)


def _layers_hint(first: str, other: str, layers: list[int]) -> str:
    """How to settle a conflict between the run's first source of target layers and another one."""
    if other.startswith("--teacher-cache"):
        fix = f"build a teacher cache of those layers (`jetflow cache-teacher --layers {','.join(map(str, layers))}`)"
    else:
        fix = "drop --target-layers" if other == "--target-layers" else "resume with the --init-from the run began with"
    if first == "--target-layers":
        return f"{fix}, or drop --target-layers to train a new head on the cache's layers"
    return f"a trained head keeps the layers it was trained on; {fix}"


def tap_layers(target: TargetModel, source: str, layers: list[int]) -> None:
    """Make ``target`` give the features of ``layers``, refused by name where it has no such layer."""
    try:
        target.set_tapped_layers(layers)
    except ValueError as e:
        raise JetFlowError(f"{source}: {e} ({target.name} has {target.num_layers} layers)") from None


def train_drafter(target: TargetModel, data: str | Path | list[str | Path], out: str | Path, config: TrainConfig, *,
                  init_from: str | Path | None = None, max_sequences: int | None = None,
                  teacher_cache: str | Path | None = None, resume: bool = False, max_steps: int | None = None,
                  snapshot_at: tuple[float, ...] = (), target_layers: list[int] | None = None) -> dict:
    """Train a drafter on regeneration dir(s) ``data`` into ``out``; returns :meth:`Trainer.fit`'s summary.
    An ``out`` holding a run is continued with ``resume`` and refused without (never overwritten);
    ``snapshot_at``: fractions of the total steps at which a copy of the drafter is kept;
    ``target_layers``: the target layers a new head reads (:func:`head_target_layers`)."""
    out = Path(out)
    if (out / "trainer_state").exists() and not resume:  # (before the data loads and the target runs)
        raise JetFlowError(f"{out} already holds a training run; pass --resume or choose another --out")
    chosen = head_target_layers(out, target_layers=target_layers, init_from=init_from, teacher_cache=teacher_cache,
                                resume=resume)
    if chosen is not None:  # (a new head reads the target's current taps; a resumed one is such a head)
        tap_layers(target, *chosen)
    head = warm_start_head(init_from, target, config) if init_from else None
    sequences = load_sequences(data, target, max_sequences)
    trainer = Trainer(target, sequences, out, config, head=head, teacher_cache=teacher_cache)
    if resume and trainer.resume():
        print(f"resumed at step {trainer.step}/{trainer.total_steps}", file=sys.stderr)
    elif (out / "drafter").exists():  # a head without a run's state: its first save cut short, or put there
        raise JetFlowError(f"{out / 'drafter'} holds a drafter but {out} has no training state to resume from; "
                           "training would replace it: choose another --out (or move the drafter away)")
    else:
        if resume:
            print(f"nothing to resume in {out}: training from step 0", file=sys.stderr)
        (out / "train_log.jsonl").unlink(missing_ok=True)  # a log of a run that never saved: not this run's
    snapshots = tuple(max(1, round(f * trainer.total_steps)) for f in snapshot_at)
    return trainer.fit(max_steps=max_steps, snapshots=snapshots)
