"""Draft-head training: frozen target as teacher, block distillation, resumable, data parallel.

Each step takes ``batch_size`` regenerated sequences per process. For each sequence the teacher
(the target run online, or its offline cache) gives the tapped features of every position and the
next-token distributions at the teacher positions; K anchors are drawn inside the answer, and all K
blocks go through the head in one forward with the training mask. The data order and the anchors
depend only on the seed, the step and the sequence's place in the global batch, so a resumed run
sees exactly what the uninterrupted run would have seen, whatever the number of processes.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from jetflow.data.shards import REGENERATED, Sequence, check_distinct, list_shards, read_shard
from jetflow.errors import JetFlowError
from jetflow.models.checkpoint import new_head
from jetflow.models.draft_head import HEAD_KINDS, DraftHead, DraftHeadConfig
from jetflow.models.draft_vocab import select_draft_vocab, target_to_draft_index, token_counts
from jetflow.models.target import TargetModel
from jetflow.training.block_objective import block_batch_loss
from jetflow.training.eagle_objective import eagle_batch_loss
from jetflow.training.losses import LOSSES
from jetflow.training.plot import plot_training_log
from jetflow.training.teacher import CachedTeacher, OnlineTeacher
from jetflow.training.teacher_cache import TeacherCache, tokens_digest
from jetflow.utils.fs import recover_directory, read_manifest, replace_directory, write_text_atomic

# Head kind -> the loss of each sequence of a micro-batch (the block head drafts all depths at once;
# the EAGLE head is unrolled).
OBJECTIVES = {"block": block_batch_loss, "eagle3": eagle_batch_loss}
AMP_DTYPES = {"": None, "bfloat16": torch.bfloat16}  # fp16 would need a gradient scaler
EVAL_SEQUENCES = 16  # sequences a run holds out (at most a fifth of them): eval loss, agreement, `jetflow calibrate --held-out`


@dataclass
class TrainConfig:
    loss: str = "fkl"
    kl_temperature: float = 1.0
    gamma: float = 0.0
    attention: str = "causal"
    block_size: int = 16
    anchors_per_seq: int = 16
    layers: int = 2
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    epochs: int = 1
    batch_size: int = 4
    grad_accum: int = 1
    clip: float = 1.0
    seed: int = 0
    save_every: int = 100
    eval_every: int = 100
    eval_sequences: int = EVAL_SEQUENCES
    draft_vocab: int = 0  # 0: predict the full target vocabulary
    feed_last_feature: bool = False
    depth_embedding: bool = False
    head: str = "block"  # "block" (JetFlow / DFlash) or "eagle3" (the autoregressive baseline)
    ttt_steps: int = 0  # eagle3: unroll steps of training-time test (0: the head's deepest level)
    # block heads: weight of an extra loss term, the mean depth-1 loss over blocks [anchor, MASK] at
    # every answer position (0: off). The usual anchors_per_seq random anchors supervise depth 1 at
    # only K positions per sequence; an EAGLE head's first unroll step supervises all of them.
    dense_depth1: float = 0.0
    # The dense term over a random sample of this many answer positions per sequence (0: all of
    # them): the full term costs as much head compute as 16-slot blocks at 36 anchors, so at equal
    # training time it did not pay (docs/results.md, "Equal training time").
    dense_depth1_anchors: int = 0
    embed_norm: bool = False  # block heads: RMS-normalise the slots' token embeddings (DraftHeadConfig.embed_norm)
    # causal block heads: the share of training blocks whose first m slots (m uniform in 1..B-2) hold
    # the true next tokens instead of MASK (unsupervised), so the later slots learn to predict what
    # follows a given path: the head's second, path-conditioned pass (decoding/refine.py). 0: off.
    reveal: float = 0.0
    slot_token_gain: float = 1.0  # block heads: DraftHeadConfig.slot_token_gain
    shift_tokens: bool = False  # causal block heads: DraftHeadConfig.shift_tokens
    path_projection: bool = False  # with shift_tokens: DraftHeadConfig.path_projection
    # Mixed precision of the head's forward and backward ("bfloat16"; "" = off). The weights, the
    # optimizer and the losses stay fp32; on CPUs with AMX a bf16 matmul is ~8x an fp32 one.
    amp: str = ""
    # Sequences per target and head forward (packed end to end; the same losses either way, tested).
    # 0: the whole micro-batch on a GPU, where per-sequence forwards are bound by kernel launches,
    # and 1 on the CPU, where packing pays for padding and a wider attention (benchmarks/bench_train_step.py).
    pack_sequences: int = 0
    # Wall-clock training budget in seconds (0 = off): training stops once it is spent, and the
    # cosine schedule follows time as well as steps, so a budgeted run still ends at a low rate.
    # For comparisons at equal training time between heads whose steps cost differently.
    max_seconds: float = 0.0

    def __post_init__(self):
        if self.head not in HEAD_KINDS:
            raise JetFlowError(f"head must be one of {HEAD_KINDS}, got {self.head!r}")
        if self.ttt_steps < 0:
            raise JetFlowError(f"ttt_steps must be >= 0, got {self.ttt_steps}")
        if self.ttt_steps and self.head != "eagle3":
            raise JetFlowError("--ttt-steps unrolls an eagle3 head's training-time test; a block head drafts every "
                               "depth in one forward and has none")
        if self.loss not in LOSSES:
            raise JetFlowError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.draft_vocab < 0:
            raise JetFlowError(f"draft_vocab must be >= 0 (0 = full vocabulary), got {self.draft_vocab}")
        for name in ("block_size", "anchors_per_seq", "layers", "epochs", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise JetFlowError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise JetFlowError(f"block_size must be >= 2 (the anchor and at least one draft slot), got {self.block_size}")
        for name in ("lr", "gamma", "kl_temperature", "slot_token_gain", "max_seconds", "reveal", "dense_depth1"):
            if not math.isfinite(getattr(self, name)):
                raise JetFlowError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise JetFlowError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.dense_depth1 < 0:
            raise JetFlowError(f"dense_depth1 must be >= 0 (0 = off), got {self.dense_depth1}")
        if self.dense_depth1_anchors < 0:
            raise JetFlowError(f"dense_depth1_anchors must be >= 0 (0 = every answer position), got "
                               f"{self.dense_depth1_anchors}")
        if self.dense_depth1 > 0 and (self.head != "block" or self.attention != "causal"):
            raise JetFlowError("dense depth-1 blocks are for causal block heads (a 2-slot block equals slot 1 of a "
                               "full block only under causal attention; an EAGLE head's first step is dense already)")
        if self.slot_token_gain <= 0:
            raise JetFlowError(f"slot_token_gain must be > 0, got {self.slot_token_gain}")
        if not 0 <= self.reveal <= 1:
            raise JetFlowError(f"reveal must be in [0, 1], got {self.reveal}")
        if self.reveal > 0 and (self.head != "block" or self.attention != "causal" or self.block_size < 3):
            raise JetFlowError("revealed blocks (--reveal) train the path-conditioned pass of causal block heads "
                               "with a block of at least 3 slots")
        if self.shift_tokens and (self.head != "block" or self.attention != "causal"):
            raise JetFlowError("--shift-tokens is for causal block heads (a bidirectional slot would see its own token "
                               "through the next slot)")
        if self.path_projection and not self.shift_tokens:
            raise JetFlowError("--path-projection projects the token a slot reads from the slot before it: it needs "
                               "--shift-tokens")
        if self.pack_sequences < 0:
            raise JetFlowError(f"pack_sequences must be >= 0 (0 = by device), got {self.pack_sequences}")
        if self.amp not in AMP_DTYPES:
            raise JetFlowError(f"amp must be one of {sorted(AMP_DTYPES)} ('' = off), got {self.amp!r}")
        if self.max_seconds < 0:
            raise JetFlowError(f"max_seconds must be >= 0 (0 = no time budget), got {self.max_seconds}")
        if self.lr <= 0 or self.kl_temperature <= 0 or self.gamma < 0:
            raise JetFlowError("lr and kl_temperature must be > 0 and gamma >= 0")


def load_sequences(data: str | Path | list[str | Path], target: TargetModel,
                   max_sequences: int | None = None) -> list[Sequence]:
    """All sequences of one or more regeneration directories, in the order given and shard order
    within each (the first ``max_sequences`` of them, for learning curves over data size), checked
    against the target. A directory that keeps growing (a regeneration still running) goes last:
    the sequences before it then keep their places."""
    dirs = data_dirs(data)
    if not dirs:
        raise JetFlowError("no regenerated data directory given")
    check_distinct(dirs)
    sequences = [s for d in dirs for s in _directory_sequences(d, target)]
    if max_sequences is None:
        return sequences
    if max_sequences > len(sequences):
        raise JetFlowError(f"--max-sequences {max_sequences}: {data_label(dirs)} "
                           f"{'holds' if len(dirs) == 1 else 'hold'} only {len(sequences)}")
    return sequences[:max_sequences]


def data_dirs(data: str | Path | list[str | Path]) -> list[Path]:
    """One regeneration directory or several, as a list."""
    return [Path(data)] if isinstance(data, (str, Path)) else [Path(d) for d in data]


def data_label(data: str | Path | list[str | Path]) -> str:
    """The directories as reports and manifests name them: comma-separated, in order."""
    return ",".join(map(str, data_dirs(data)))


def _directory_sequences(data_dir: Path, target: TargetModel) -> list[Sequence]:
    manifest = read_manifest(data_dir, REGENERATED)
    if manifest is None:
        raise JetFlowError(f"{data_dir} has no manifest.json: not a `jetflow regenerate` output")
    made_for, identity = manifest.get("target", {}), target.identity()
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if made_for.get(key) != identity[key]:
            raise JetFlowError(f"{data_dir} was regenerated by {made_for.get('name')!r} ({key} {made_for.get(key)}), "
                               f"not by target {target.name!r} ({key} {identity[key]})")
    if made_for.get("weights") and identity.get("weights") and made_for["weights"] != identity["weights"]:
        # Another checkpoint of the same shape: a fine-tune, or the same model quantized otherwise
        # (data regenerated from a GGUF, training on the original): said, not refused.
        print(f"jetflow: note: {data_dir} was regenerated by other weights than this target's "
              f"({made_for['weights']} against {identity['weights']}); fine if they are one model "
              "quantized otherwise, not if it is another checkpoint", file=sys.stderr)
    sequences = [s for path in list_shards(data_dir) for s in read_shard(path)]
    sequences = [s for s in sequences if s.answer_len >= 2]
    if not sequences:
        raise JetFlowError(f"{data_dir} holds no sequences with an answer of 2+ tokens")
    too_long = [s.prompt_id for s in sequences if len(s.token_ids) > target.max_context]
    if too_long:
        raise JetFlowError(f"{data_dir}: {len(too_long)} sequences exceed the target's context ({target.max_context}), "
                           f"e.g. {too_long[0]}")
    if max(max(s.token_ids) for s in sequences) >= target.vocab_size:
        raise JetFlowError(f"{data_dir} holds token ids outside the target's vocabulary")
    return sequences


def held_out_split(num_sequences: int, seed: int, eval_sequences: int) -> tuple[list[int], list[int]]:
    """(held-out, training) indices into a run's sequences: a seeded shuffle, at most a fifth held out."""
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(eval_sequences, num_sequences // 5)
    return order[:n_eval], order[n_eval:]


class Trainer:
    def __init__(self, target: TargetModel, sequences: list[Sequence], out_dir: str | Path, config: TrainConfig,
                 head: DraftHead | None = None, teacher_cache: str | Path | None = None):
        self.target, self.config, self.out = target, config, Path(out_dir)
        self.sequences = sequences
        self.data_digest = tokens_digest(sequences)  # a run resumes only on the very same sequences
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.eval_set, self.train_set = held_out_split(len(sequences), config.seed, config.eval_sequences)
        torch.manual_seed(config.seed)
        fresh_head = head is None
        if head is None:
            vocab = config.draft_vocab if 0 < config.draft_vocab < target.vocab_size else None
            head = new_head(DraftHeadConfig.for_target(
                target, num_hidden_layers=config.layers, block_size=config.block_size, attention=config.attention,
                draft_vocab_size=vocab, feed_last_feature=config.feed_last_feature,
                depth_embedding=config.depth_embedding, kind=config.head, embed_norm=config.embed_norm,
                slot_token_gain=config.slot_token_gain, shift_tokens=config.shift_tokens,
                path_projection=config.path_projection))
        if head.config.reduced_vocab:
            # The most frequent answer tokens of this run's training split, stop tokens always in. A
            # warm-started head takes them too: its output rows are the target's LM-head rows, so no
            # learned weight depends on which tokens they are, and new data (e.g. more chat) brings
            # its own frequent tokens. A resumed run loads its saved vocabulary over this one.
            counts = token_counts((sequences[i] for i in self.train_set), target.vocab_size)
            head.set_draft_vocab(select_draft_vocab(counts, head.config.draft_vocab_size, target.stop_token_ids()))
        # A warm-started head reads its own layers (the target's default taps may be others'): the
        # online teacher's features must be those decoding will give it.
        target.set_tapped_layers(head.config.target_layer_ids)
        self.head = head.to(target.device).train()
        if config.reveal > 0:  # the checkpoint says its head can run the path-conditioned pass
            self.head.config.path_refine = True
        self.embed = target.embed
        self.teacher_cache = teacher_cache
        self._bind_vocab()
        if fresh_head:
            self.head.set_feature_scale(self.sample_features())
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        per_step = config.batch_size * config.grad_accum * self.world
        self.steps_per_epoch = max(1, len(self.train_set) // per_step)
        self.total_steps = self.steps_per_epoch * config.epochs
        self.step = 0
        self.elapsed = 0.0  # training seconds over all sessions of this run
        self.lr = config.lr  # the rate of the last step
        self.clock = time.perf_counter

    def _bind_vocab(self) -> None:
        """LM-head slice, label mapping and teacher for the head's (possibly reduced) vocabulary."""
        target, draft_ids = self.target, self.head.draft_ids
        self.lm_weight = self.head.output_weight(target.lm_head_weight()).detach()
        self.label_index = None if draft_ids is None else target_to_draft_index(draft_ids.cpu(), target.vocab_size)
        if self.teacher_cache is None:
            self.teacher = OnlineTeacher(target, draft_ids)
        else:
            cache = TeacherCache(self.teacher_cache, self.sequences, target, self.head.config.target_layer_ids)
            self.teacher = CachedTeacher(cache, draft_ids, target.vocab_size, target.device)

    def sample_features(self, count: int = 32) -> torch.Tensor:
        """Tapped features of up to ``count`` training sequences, first position (attention sink)
        left out: the statistics behind the head's feature scale."""
        picks = self.train_set[:count]
        feats = [self.teacher.fetch(i, self.sequences[i], torch.zeros(0, dtype=torch.long))[0][1:] for i in picks]
        return torch.cat(feats)

    # ------------------------------------------------------------------ schedule and data order
    def lr_at(self, step: int) -> float:
        c = self.config
        if c.warmup_steps and step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        progress = (step - c.warmup_steps) / max(1, self.total_steps - c.warmup_steps)
        if c.max_seconds:  # whichever runs out first: the steps or the time
            progress = max(progress, self.elapsed / c.max_seconds)
        return c.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def batch_for(self, step: int, micro: int) -> list[tuple[int, int]]:
        """(slot in the global batch, sequence index) of this process's share of a micro-batch."""
        c = self.config
        epoch, within = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(self.train_set), generator=torch.Generator().manual_seed(c.seed * 1000 + epoch))
        start = ((within * c.grad_accum + micro) * self.world + self.rank) * c.batch_size
        return [(start + k, self.train_set[i]) for k, i in enumerate(order[start:start + c.batch_size].tolist())]

    # ------------------------------------------------------------------ one sequence
    def batch_loss(self, items: list[tuple[int, torch.Generator]]) -> tuple[torch.Tensor, dict]:
        """The loss of each sequence [S] of ``items`` (sequence index, the generator its anchors come
        from), computed together, and the per-depth agreement of their slots."""
        amp = AMP_DTYPES[self.config.amp]
        with torch.autocast(self.target.device.type, dtype=amp, enabled=amp is not None):
            return OBJECTIVES[self.head.kind](self, items)

    def packs(self, items: list) -> list[list]:
        """``items`` in groups of the sequences that share one forward (``pack_sequences``)."""
        size = self.config.pack_sequences or (1 if self.target.device.type == "cpu" else len(items))
        return [items[i:i + size] for i in range(0, len(items), max(1, size))]

    def sequence_loss(self, index: int, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        loss, info = self.batch_loss([(index, generator)])
        return loss[0], info

    def train_step(self) -> float:
        c = self.config
        self.lr = lr = self.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        global_batch = c.batch_size * self.world
        for micro in range(c.grad_accum):
            # Anchors depend on the sequence's place in the global batch, not on the process.
            items = [(index, torch.Generator().manual_seed((c.seed * 1_000_003 + self.step) * 65_537 + slot))
                     for slot, index in self.batch_for(self.step, micro)]
            for pack in self.packs(items):
                losses, _ = self.batch_loss(pack)
                (losses.sum() * self.world / (global_batch * c.grad_accum)).backward()
                total += float(losses.detach().sum()) / (global_batch * c.grad_accum)
        if self.world > 1:  # data parallel: average the gradients of all processes (gloo or nccl)
            for p in self.head.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= self.world
            dist.all_reduce(total)
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), c.clip)
        self.optimizer.step()
        self.step += 1
        return float(total)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss and per-depth top-1 agreement of draft and target (the target's top-1 over
        its full vocabulary: with a reduced draft vocabulary, one the head cannot propose is a miss)."""
        self.head.eval()
        g = torch.Generator().manual_seed(12345)
        losses, depth_hits, depth_counts = [], {}, {}
        # One generator for all, drawn from in order: the same anchors whatever the packing.
        for pack in self.packs([(index, g) for index in self.eval_set]):
            loss, info = self.batch_loss(pack)
            losses.extend(loss.tolist())
            for d, a in zip(info["depth"].tolist(), info["agree"].tolist()):
                depth_hits[d] = depth_hits.get(d, 0) + a
                depth_counts[d] = depth_counts.get(d, 0) + 1
        self.head.train()
        return {"eval_loss": sum(losses) / max(1, len(losses)),
                "top1_agreement": [depth_hits[d] / depth_counts[d] for d in sorted(depth_counts)]}

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        if self.rank != 0:
            return
        self.head.save_pretrained(self.out / "drafter")
        # The state holds the weights too: a kill between the two saves leaves the drafter one save
        # ahead of the optimizer and step, and a resume must take all three from one save.
        with replace_directory(self.out / "trainer_state") as tmp:
            torch.save({"step": self.step, "optimizer": self.optimizer.state_dict(), "elapsed": self.elapsed,
                        "config": asdict(self.config), "data_digest": self.data_digest, "world": self.world,
                        "head": self.head.state_dict()}, tmp / "state.pt")
        plot_training_log(self.out / "train_log.jsonl", self.out / "loss_curve.png")

    def resume(self) -> bool:
        for saved in ("drafter", "trainer_state"):  # a save that a kill interrupted is finished first
            recover_directory(self.out / saved)
        state_file = self.out / "trainer_state" / "state.pt"
        if not state_file.is_file():
            return False
        state = torch.load(state_file, weights_only=False)
        if {**asdict(TrainConfig()), **state["config"]} != asdict(self.config):  # older runs lack newer fields
            raise JetFlowError(f"{self.out} was trained with other settings; resume with the same arguments")
        if state.get("data_digest", self.data_digest) != self.data_digest:  # older runs lack it
            raise JetFlowError(f"{self.out} was trained on other sequences (the data directories, their order or "
                               "--max-sequences differ, or a directory has grown); resume with the same data, e.g. "
                               "--max-sequences set to the run's count")
        if state.get("world", self.world) != self.world:  # older runs lack it
            raise JetFlowError(f"{self.out} was trained by {state['world']} processes; resume it with as many "
                               f"(which sequences a step takes depends on it), not {self.world}")
        if "head" in state:  # the weights of the same save as the step and optimizer
            self.head.load_state_dict(state["head"])
        else:  # a state saved before it held the weights
            loaded = type(self.head).from_pretrained(self.out / "drafter", target=self.target, device=self.target.device)
            self.head.load_state_dict(loaded.state_dict())
        self._bind_vocab()
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed = state["step"], state.get("elapsed", 0.0)
        log_file = self.out / "train_log.jsonl"
        if self.rank == 0 and log_file.is_file():  # steps past the checkpoint are trained again: log them once
            kept = [line for line in log_file.read_text().splitlines() if _logged_step(line) <= self.step]
            write_text_atomic(log_file, "".join(line + "\n" for line in kept))
        return True

    def out_of_time(self) -> bool:
        return bool(self.config.max_seconds) and self.elapsed >= self.config.max_seconds

    def fit(self, max_steps: int | None = None, log=print, snapshots: tuple[int, ...] = ()) -> dict:
        """Train until ``max_steps`` (default: all epochs) or the config's time budget; ``snapshots``
        are steps at which a copy of the drafter is kept in ``snapshots/step-NNNNNN`` (e.g. for a
        learning curve)."""
        self.out.mkdir(parents=True, exist_ok=True)
        log_file = self.out / "train_log.jsonl"
        end = self.total_steps if max_steps is None else min(self.total_steps, max_steps)
        while self.step < end and not self.out_of_time():
            t0 = self.clock()
            loss = self.train_step()
            self.elapsed += self.clock() - t0
            if self.config.max_seconds and self.world > 1:  # every process stops at the same step
                spent = torch.tensor([self.elapsed], dtype=torch.float64)
                dist.all_reduce(spent, op=dist.ReduceOp.MAX)
                self.elapsed = spent.item()
            last = self.step == end or self.out_of_time()
            record = {"step": self.step, "loss": loss, "lr": self.lr, "seconds": self.elapsed}
            if self.eval_set and (self.step % self.config.eval_every == 0 or last):
                record.update(self.evaluate())
            if self.rank == 0:
                with open(log_file, "a") as f:
                    f.write(json.dumps(record) + "\n")
                log(record)
            if self.step % self.config.save_every == 0 or last:
                self.save()
            if self.step in snapshots and self.rank == 0:
                self.head.save_pretrained(self.out / "snapshots" / f"step-{self.step:06d}")
        return {"step": self.step, "total_steps": self.total_steps, "train_sequences": len(self.train_set),
                "seconds": round(self.elapsed, 1)}


def _logged_step(line: str) -> float:
    """The step of a training-log line; infinity for a line a kill cut short (dropped on resume)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
