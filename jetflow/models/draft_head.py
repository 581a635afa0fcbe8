"""The JetFlow block draft head (and, with ``attention="bidirectional"``, the DFlash baseline).

The head reads the target's hidden states at the tapped layers, fuses them (concat -> ``fc`` ->
``hidden_norm``) and injects the fused context as extra keys/values into every one of its decoder
layers. Its queries are one block ``[anchor, MASK x (B-1)]`` at absolute positions; one forward gives
the distribution of the token at every depth 1..B-1. Embedding and LM head are the target's.

Weights and config follow the DFlash naming (``layers.N.self_attn.q_proj``, ``fc``, ``hidden_norm``,
``dflash_config``) so checkpoints can be exported to vLLM without renaming.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from jetflow.errors import JetFlowError
from jetflow.models.draft_vocab import mapping_tensors
from jetflow.models.identity import tokenizer_digest
from jetflow.models.layers import DecoderLayer, RMSNorm, Rotary
from jetflow.tree.calibration import TreeCalibration
from jetflow.utils.fs import replace_directory

ATTENTION_KINDS = ("causal", "bidirectional")
HEAD_KINDS = ("block", "eagle3")  # block: JetFlow/DFlash parallel head; eagle3: autoregressive baseline
ARCHITECTURES = {"block": "JetFlowDraftModel", "eagle3": "JetFlowEagle3Model"}


CHECKPOINT_FILES = ("config.json", "model.safetensors")  # what save_pretrained writes (and may replace)


class DrafterMismatchError(JetFlowError):
    """A drafter checkpoint does not fit the target (or is not a drafter checkpoint at all)."""


@dataclass
class DraftHeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_hidden_layers: int = 2
    block_size: int = 16
    attention: str = "causal"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    draft_vocab_size: int | None = None  # None: the full target vocabulary
    # Add the anchor's embedding and the fused target feature of the last committed position (the
    # one before the anchor) to every block slot's input, so both reach each slot without first
    # having to learn a sharp attention onto two positions out of hundreds.
    feed_last_feature: bool = False
    # A learned embedding of each slot's depth added to its input: MASK slots are otherwise identical
    # and can tell "next token" from "8 tokens ahead" only through rotary attention patterns.
    depth_embedding: bool = False
    # RMS-normalise the token embeddings of the block slots (learned scale) before they are summed
    # with the fused target feature: SmolLM2's embeddings have RMS ~0.13 against ~1 for the fused
    # (RMS-normed) feature, so in the sum the anchor token is a small part of the slot's input.
    embed_norm: bool = False
    # Multiplies the token embeddings of the slots after the anchor (MASK in the first pass, a draft
    # path's tokens in the second): at SmolLM2's embedding RMS (~0.13) a revealed token is a small
    # part of a slot's input next to the fused target feature (~1).
    slot_token_gain: float = 1.0
    # Trained with revealed blocks (``jetflow train --reveal``): slots after a draft path's tokens
    # predict what follows that path, so decoding can run a second, path-conditioned pass
    # (decoding/refine.py).
    path_refine: bool = False
    # Each slot reads the token of the slot before it in place of its own, as a language model's inputs are shifted against its outputs. In the first
    # pass this changes only slot 1 (the anchor instead of MASK); in a revealed block the slot after
    # the last path token gets that token in its own input, where a head trained for 248 steps
    # ignores it when it can only reach it through attention (docs/results.md, path-conditioned pass).
    # A slot never reads its own token, so revealed slots can be supervised as well.
    shift_tokens: bool = False
    # With shift_tokens: the token a slot after the anchor reads (its parent's) passes a projection of
    # its own (RMSNorm + linear), as the EAGLE head's token input does, instead of being summed at the
    # embedding's scale (RMS ~0.13) with the fused target feature (~1). Scaling the raw embedding up
    # (slot_token_gain) taught a head the path only at the cost of its first pass (docs/results.md,
    # "Path-conditioned second pass").
    path_projection: bool = False
    # Maps draft log-probabilities to acceptance log-probabilities when building trees
    # (tree/calibration.py; written by ``jetflow calibrate``). None: trees rank nodes by draft log-prob.
    tree_calibration: dict | None = None
    target: dict = field(default_factory=dict)  # identity of the target the head was built for
    # "block": one forward drafts block_size - 1 depths. "eagle3": the autoregressive baseline
    # (jetflow/models/eagle_head.py); there block_size is the deepest draft tree level + 1.
    kind: str = "block"

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"kind must be one of {HEAD_KINDS}, got {self.kind!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        if self.path_projection and not self.shift_tokens:
            raise ValueError("path_projection needs shift_tokens (it projects the token a slot reads from its parent)")
        if self.tree_calibration is not None:
            TreeCalibration.from_json(self.tree_calibration)  # refuse a malformed one at load time

    @property
    def calibration(self) -> TreeCalibration | None:
        return None if self.tree_calibration is None else TreeCalibration.from_json(self.tree_calibration)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size < self.vocab_size

    @classmethod
    def for_target(cls, target, *, num_hidden_layers: int = 2, block_size: int = 16, attention: str = "causal",
                   mask_token_id: int | None = None, draft_vocab_size: int | None = None,
                   feed_last_feature: bool = False, depth_embedding: bool = False,
                   kind: str = "block", embed_norm: bool = False, slot_token_gain: float = 1.0,
                   shift_tokens: bool = False, path_projection: bool = False) -> "DraftHeadConfig":
        """A head shaped like the target's own layers (same width, heads and RoPE)."""
        shape = target.shape()
        return cls(
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            head_dim=shape.head_dim,
            vocab_size=shape.vocab_size,
            mask_token_id=(choose_mask_token_id(target.tokenizer, shape.vocab_size) if mask_token_id is None
                           else mask_token_id),
            target_layer_ids=list(target.tapped_layers),
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            attention=attention,
            rms_norm_eps=shape.rms_norm_eps,
            rope_theta=shape.rope_theta,
            max_position_embeddings=target.max_context,
            draft_vocab_size=draft_vocab_size,
            feed_last_feature=feed_last_feature,
            depth_embedding=depth_embedding,
            embed_norm=embed_norm,
            slot_token_gain=slot_token_gain,
            shift_tokens=shift_tokens,
            path_projection=path_projection,
            target=_target_record(target),
            kind=kind,
        )

    def to_json(self) -> dict:
        """config.json in the DFlash layout (a Qwen3-style config plus ``dflash_config``)."""
        d = asdict(self)
        mask_token_id, layer_ids = d.pop("mask_token_id"), d.pop("target_layer_ids")
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        if d["tree_calibration"] is None:
            del d["tree_calibration"]  # only calibrated checkpoints carry one
        return {
            "architectures": [ARCHITECTURES[self.kind]],
            "model_type": "qwen3",
            **d,
            "num_target_layers": self.target.get("num_hidden_layers"),
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": layer_ids,
                              "causal": self.attention == "causal"},
        }

    @classmethod
    def from_json(cls, d: dict) -> "DraftHeadConfig":
        d = dict(d)
        dflash = d.pop("dflash_config")
        rope = d.pop("rope_parameters", None)
        rope = {} if rope is None else rope
        if not isinstance(rope, dict):
            raise ValueError(f"'rope_parameters' must be an object, got {type(rope).__name__}")
        if d.get("target") is not None and not isinstance(d["target"], dict):
            raise ValueError(f"'target' must be an object describing the target model, got {type(d['target']).__name__}")
        # rope_parameters first (transformers 5's layout, what save_pretrained writes), else a top-level
        # rope_theta (older layouts, as configs written elsewhere have it)
        theta = rope.get("rope_theta", d.pop("rope_theta", 10000.0))
        names = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in d.items() if k in names}
        if "causal" in dflash:  # the DFlash layout's own flag (a config written elsewhere may have no "attention")
            said = "causal" if dflash["causal"] else "bidirectional"
            if kwargs.setdefault("attention", said) != said:
                raise ValueError(f"'attention' is {kwargs['attention']!r} but dflash_config.causal is {dflash['causal']}")
        return cls(mask_token_id=dflash["mask_token_id"], target_layer_ids=list(dflash["target_layer_ids"]),
                   rope_theta=theta, **kwargs)


def choose_mask_token_id(tokenizer, vocab_size: int) -> int:
    """A token id for the MASK slots: the tokenizer's mask token, else an unused special token."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    busy = {getattr(tokenizer, a, None) for a in ("eos_token_id", "bos_token_id", "pad_token_id")}
    specials = [tokenizer.convert_tokens_to_ids(t) for t in getattr(tokenizer, "all_special_tokens", [])]
    candidates = [i for i in specials + [getattr(tokenizer, "unk_token_id", None)]
                  if i is not None and i not in busy and 0 <= i < vocab_size]
    return max(candidates) if candidates else vocab_size - 1


class DraftHead(nn.Module):
    kind = "block"  # the DraftHeadConfig.kind this class implements

    def __init__(self, config: DraftHeadConfig):
        if config.kind != self.kind:
            raise ValueError(f"{type(self).__name__} needs a config with kind={self.kind!r}, got {config.kind!r}")
        super().__init__()
        self.config = c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                         c.head_dim, c.rms_norm_eps)
            for _ in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        self.depth_embed = nn.Embedding(c.block_size, c.hidden_size) if c.depth_embedding else None
        self.slot_embed_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.embed_norm else None
        self.path_proj = (nn.Sequential(RMSNorm(c.hidden_size, c.rms_norm_eps),
                                        nn.Linear(c.hidden_size, c.hidden_size, bias=False))
                          if c.path_projection else None)
        # Per-dimension scale of the tapped target features (their RMS over training data). Targets
        # carry massive activations: in SmolLM2 a few dimensions hold a large, nearly constant value
        # (|mean| ~450 in layer 27 against a typical spread of ~15), so the raw concatenation is
        # dominated by them and the head learns to read the informative dimensions only slowly.
        # Dividing by the RMS puts every dimension on one scale; it folds into ``fc`` for export.
        self.register_buffer("feature_scale", torch.ones(len(c.target_layer_ids) * c.hidden_size))
        if c.reduced_vocab:  # EAGLE-3 names, so vLLM reads the mapping as is
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    # ---------------------------------------------------------------- draft vocabulary
    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """Install the sorted target ids the head predicts (a reduced-vocabulary head only)."""
        if not self.config.reduced_vocab or draft_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"head expects {self.config.draft_vocab_size} draft ids, got {draft_ids.numel()}")
        d2t, t2d = mapping_tensors(draft_ids.cpu(), self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """Target id of each draft id, or None when the head predicts the full vocabulary."""
        if not self.config.reduced_vocab:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def with_draft_vocab(self, draft_ids: torch.Tensor | None) -> "DraftHead":
        """The same weights predicting another set of target ids (None: the whole vocabulary). No
        learned weight depends on the set: the output rows are the target's own LM-head rows. The tree
        calibration is dropped, since the draft log-probabilities it was fitted on change."""
        size = None if draft_ids is None or draft_ids.numel() >= self.config.vocab_size else draft_ids.numel()
        head = type(self)(replace(self.config, draft_vocab_size=size, tree_calibration=None))
        state = {k: v for k, v in self.state_dict().items() if k not in ("d2t", "t2d")}
        head.load_state_dict(state, strict=False)
        if size is not None:
            head.set_draft_vocab(draft_ids)
        return head.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    def output_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The rows of the target's (shared, frozen) LM head that the head predicts."""
        ids = self.draft_ids
        return lm_head_weight if ids is None else lm_head_weight.index_select(0, ids.to(lm_head_weight.device))

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, nn.Embedding):  # depth embedding: on the scale of the normed inputs
                nn.init.normal_(m.weight, std=0.5)

    # ---------------------------------------------------------------- forward pieces
    @property
    def dtype(self) -> torch.dtype:
        """The head's float dtype (read off a norm: a copy with int8 linears keeps its norms float)."""
        return self.norm.weight.dtype

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Tapped target hidden states [..., C, taps*H] -> fused context features [..., C, H]."""
        x = features.to(self.dtype) / self.feature_scale.to(self.dtype)
        return self.hidden_norm(self.fc(x))

    @torch.no_grad()
    def set_feature_scale(self, features: torch.Tensor, eps: float = 1e-2) -> None:
        """Set the per-dimension scale from sample features [N, taps*H] (the first position of each
        sequence, an attention sink with values of ~1e4, should be left out)."""
        rms = features.float().pow(2).mean(0).sqrt().clamp(min=eps)
        self.feature_scale.copy_(rms.to(self.feature_scale))

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys/values of the fused context, each [..., kv_heads, C, head_dim]."""
        cos, sin = self.rotary.cos_sin(positions, fused.dtype)
        return [layer.self_attn.key_value(fused, cos, sin) for layer in self.layers]

    def forward(self, block_embeds, positions, context_kv, mask, last_feature=None,
                block_size: int | None = None, depths: torch.Tensor | None = None) -> torch.Tensor:
        """Block hidden states after the final norm, [..., Q, H].

        block_embeds [..., Q, H] (the target's embeddings of the block tokens), positions [..., Q],
        context_kv from :meth:`context_kv`, mask boolean [..., Q, C+Q] over [context, block];
        last_feature ([..., Q, H] or [H]): the fused context feature just before each slot's anchor,
        used when ``config.feed_last_feature``; ``block_size``: slots per block in ``block_embeds`` when
        they are not ``config.block_size`` (training's 2-slot depth-1 blocks); default: whole blocks, or
        one block of Q < block_size slots. ``depths`` [Q]: the slots are one tree instead (the
        path-conditioned pass, decoding/refine.py): slot 0 is the anchor, slot i sits at depth
        ``depths[i]`` below it, and ``mask`` says which slots it sees; for a head that shifts tokens,
        ``block_embeds`` then already hold the token each slot reads (its parent's)."""
        x = block_embeds.to(self.dtype)
        b = block_size or min(self.config.block_size, x.shape[-2])
        if self.config.shift_tokens and depths is None:  # slot j reads slot j-1's token (the anchor its own)
            blocks = x.unflatten(-2, (-1, b))
            x = torch.cat([blocks[..., :1, :], blocks[..., :-1, :]], dim=-2).flatten(-3, -2)
        if self.slot_embed_norm is not None:
            x = self.slot_embed_norm(x)
        depth = torch.arange(x.shape[-2], device=x.device) % b if depths is None else depths
        if self.path_proj is not None:  # the anchor keeps its own embedding: feed_last_feature adds it everywhere
            x = torch.where((depth > 0)[:, None], self.path_proj(x), x)
        if self.config.slot_token_gain != 1.0:  # every slot but the anchor
            x = x * torch.where(depth > 0, self.config.slot_token_gain, 1.0).to(x.dtype)[:, None]
        if self.config.feed_last_feature:
            if last_feature is None:
                raise ValueError("this head reads the last context feature: pass last_feature")
            # Every slot starts from (anchor token, target state before it), EAGLE's input pair.
            # Whole blocks (training), or one block cut after its first Q slots (a causal head at
            # inference drafts only the depths a tree of the round's budget can reach).
            if depths is None:
                blocks = x.unflatten(-2, (-1, b))
                x = (blocks + blocks[..., :1, :]).flatten(-3, -2)
            else:
                x = x + x[..., :1, :]
            x = x + last_feature.to(x.dtype)
        if self.depth_embed is not None:  # slots are laid out block after block, depth 0..B-1 in each
            x = x + self.depth_embed(depth).to(x.dtype)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, context_kv):
            x = layer(x, cos, sin, mask, k, v)
        return self.norm(x)

    def block_mask(self, context_len: int, device=None) -> torch.Tensor:
        """Inference mask for one block after ``context_len`` context tokens: [B, C+B]."""
        b = self.config.block_size
        inner = torch.ones(b, b, dtype=torch.bool, device=device)
        if self.config.attention == "causal":
            inner = inner.tril()
        return torch.cat([torch.ones(b, context_len, dtype=torch.bool, device=device), inner], dim=1)

    # ---------------------------------------------------------------- checkpoints
    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write ``config.json`` + ``model.safetensors`` atomically (optionally cast, e.g. bf16)."""
        path = Path(path)
        state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach().cpu().contiguous()
                 for k, v in self.state_dict().items()}
        with replace_directory(path, CHECKPOINT_FILES) as tmp:
            (tmp / "config.json").write_text(json.dumps(self.config.to_json(), indent=2))
            save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        return path

    @classmethod
    def from_pretrained(cls, path: str | Path, target=None, device=None, dtype: torch.dtype | None = None) -> "DraftHead":
        """Load a checkpoint dir of this head's kind; with ``target``, refuse one built for a different
        target. A checkpoint of either kind loads with :func:`jetflow.models.checkpoint.load_drafter`."""
        return cls.load(path, read_config(path), target, device, dtype)

    @classmethod
    def load(cls, path: str | Path, config: DraftHeadConfig, target=None, device=None,
             dtype: torch.dtype | None = None) -> "DraftHead":
        """The weights of checkpoint ``path`` into a new head of ``config`` (read by :func:`read_config`)."""
        if config.kind != cls.kind:
            raise DrafterMismatchError(f"{path} holds a {config.kind!r} head, not a {cls.kind!r} one "
                                       "(load it with jetflow.models.checkpoint.load_drafter)")
        if target is not None:
            check_compatible(config, target)
        head = cls(config)
        weights = Path(path) / "model.safetensors"
        try:
            state = load_file(weights)
        except Exception as e:  # safetensors' own error type: truncated or not a safetensors file at all
            raise DrafterMismatchError(f"{weights} is not a readable safetensors file: {e}") from None
        state.setdefault("feature_scale", head.feature_scale)  # checkpoints from before the scale existed
        own = head.state_dict()
        wrong = [f"{k} has shape {list(v.shape)}, its config needs {list(own[k].shape)}"
                 for k, v in state.items() if k in own and v.shape != own[k].shape]
        if wrong:
            raise DrafterMismatchError(f"{weights} does not match its config: " + "; ".join(wrong[:4]))
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DrafterMismatchError(f"{weights} does not match its config: missing {missing[:4]}, "
                                       f"unexpected {unexpected[:4]}")
        head.to(device=device, dtype=dtype or state["fc.weight"].dtype)
        return head


def read_config(path: str | Path) -> DraftHeadConfig:
    """The config of drafter checkpoint dir ``path``, checked to be one (config.json + model.safetensors)."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise DrafterMismatchError(f"{path} is not a drafter checkpoint (needs config.json and model.safetensors)")
    try:
        return DraftHeadConfig.from_json(json.loads(cfg_file.read_text()))
    except KeyError as e:
        raise DrafterMismatchError(f"{cfg_file} is not a valid drafter config: missing field {e}") from None
    except (TypeError, ValueError) as e:
        raise DrafterMismatchError(f"{cfg_file} is not a valid drafter config: {e}") from None


def _target_record(target) -> dict:
    """What a new head's config records of its target: its identity and its vocabulary's digest."""
    digest = tokenizer_digest(getattr(target, "tokenizer", None))
    return {**target.identity(), **({"tokenizer": digest} if digest else {})}


def check_compatible(config: DraftHeadConfig, target) -> None:
    """Raise DrafterMismatchError naming every size in which the drafter and the target differ."""
    ident = target.identity()
    problems = [f"{key}: drafter was built for {config.target.get(key)}, target has {ident[key]}"
                for key in ("vocab_size", "hidden_size", "num_hidden_layers")
                if config.target.get(key) is not None and config.target.get(key) != ident[key]]
    if config.vocab_size != target.vocab_size and not any("vocab" in p for p in problems):
        problems.append(f"vocab_size: drafter has {config.vocab_size}, target has {target.vocab_size}")
    if config.hidden_size != target.hidden_size and not any("hidden" in p for p in problems):
        problems.append(f"hidden_size: drafter has {config.hidden_size}, target has {target.hidden_size}")
    made_for = config.target.get("tokenizer")
    now = tokenizer_digest(getattr(target, "tokenizer", None)) if made_for is not None and not problems else None
    if now is not None and now != made_for:
        problems.append("tokenizer: the drafter was built for another vocabulary (token ids name other strings)")
    bad_taps = [t for t in config.target_layer_ids if not 0 <= t < target.num_layers]
    if bad_taps:
        problems.append(f"target_layer_ids {bad_taps} do not exist in a {target.num_layers}-layer target")
    if problems:
        raise DrafterMismatchError(
            f"drafter for {config.target.get('name', 'an unknown target')!r} does not fit target {target.name!r}: "
            + "; ".join(problems))
