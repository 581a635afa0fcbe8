"""Export a JetFlow block head in the DFlash format vLLM loads (``method: "dflash"``).

vLLM serves the head in chain mode (it has no tree drafting); a causal JetFlow head is a DFlash head
with ``dflash_config.causal = true``. The format: a Qwen3-style ``config.json`` with
``architectures: ["DFlashDraftModel"]``, ``rope_parameters``, ``block_size``, ``dflash_config``
(``mask_token_id``, 0-based ``target_layer_ids``, ``causal``) and, for a reduced vocabulary,
``draft_vocab_size``; weights ``layers.N.*``, ``fc``, ``hidden_norm``, ``norm``; no embedding (vLLM
shares the target's). vLLM also shares the target's LM head unless the checkpoint has one, which only
fits a full-vocabulary head: a reduced-vocabulary head ships ``d2t`` (target id = draft id + d2t)
and ``lm_head.weight``, the target's LM-head rows of its draft tokens. JetFlow's per-dimension feature scale is folded
into ``fc`` (fc(x / s) = (fc.weight / s) x). Heads using options DFlash has no place for are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from jetflow.errors import JetFlowError
from jetflow.models.backend import TargetBackend
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead, DraftHeadConfig, check_compatible
from jetflow.utils.fs import replace_directory

ARCHITECTURE = "DFlashDraftModel"
EXPORT_FILES = ("config.json", "model.safetensors")  # what an export writes (and may replace)


def unsupported(config: DraftHeadConfig) -> list[str]:
    """Why vLLM's DFlash model cannot represent this head (empty: it can)."""
    reasons = []
    if config.kind != "block":
        reasons.append(f"it is a {config.kind!r} head, not a block head (train with --head block)")
    if config.feed_last_feature:
        reasons.append("it adds the anchor embedding and last target feature to every slot (--feed-last-feature); "
                       "DFlash slots only see their own token embedding")
    if config.depth_embedding:
        reasons.append("it has a learned depth embedding (--depth-embedding), which DFlash lacks")
    if config.embed_norm:
        reasons.append("it RMS-normalises the slots' token embeddings (--embed-norm), which DFlash does not")
    if config.slot_token_gain != 1.0:
        reasons.append("it scales the slots' token embeddings (--slot-token-gain), which DFlash does not")
    if config.shift_tokens:
        reasons.append("its slots read the token of the slot before them (--shift-tokens); DFlash slots read their own")
    return reasons


def vllm_config(config: DraftHeadConfig, dtype: torch.dtype) -> dict:
    c = config
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.num_hidden_layers,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_theta": c.rope_theta,  # older readers; vLLM reads rope_parameters (default theta 1e6 if absent)
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "block_size": c.block_size,
        "num_target_layers": c.target.get("num_hidden_layers"),
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                          "causal": c.attention == "causal"},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if c.reduced_vocab:
        out["draft_vocab_size"] = c.draft_vocab_size
    return out


def vllm_state_dict(head: DraftHead, dtype: torch.dtype, lm_head_weight: torch.Tensor | None = None
                    ) -> dict[str, torch.Tensor]:
    state = {}
    if head.config.reduced_vocab:
        if lm_head_weight is None:
            raise JetFlowError("a reduced-vocabulary head needs the target's LM head to export (pass the target)")
        state["lm_head.weight"] = head.output_weight(lm_head_weight.float()).to(dtype).detach().cpu().contiguous()
    for name, value in head.state_dict().items():
        if name in ("feature_scale", "t2d"):
            continue  # folded into fc / derivable from d2t
        if name == "fc.weight":
            value = value.float() / head.feature_scale.float()[None, :]
        state[name] = (value.to(dtype) if value.is_floating_point() else value).detach().cpu().contiguous()
    return state


def expected_shapes(cfg: dict, taps: int) -> dict[str, tuple[int, ...]]:
    """Every tensor the exported directory must hold, with its shape (the validation reference)."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"fc.weight": (h, taps * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    if "draft_vocab_size" in cfg:
        shapes["d2t"] = (cfg["draft_vocab_size"],)
        shapes["lm_head.weight"] = (cfg["draft_vocab_size"], h)
    return shapes


def validate(cfg: dict, state: dict[str, torch.Tensor]) -> None:
    """Raise JetFlowError unless ``state`` holds exactly the tensors ``cfg`` implies."""
    taps = len(cfg["dflash_config"]["target_layer_ids"])
    want = expected_shapes(cfg, taps)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    wrong = [f"{k} {tuple(state[k].shape)} (want {want[k]})" for k in want if k in state and tuple(state[k].shape) != want[k]]
    if missing or extra or wrong:
        raise JetFlowError(f"export would not load in vLLM: missing {missing[:4]}, unexpected {extra[:4]}, "
                           f"wrong shapes {wrong[:4]}")
    if cfg["block_size"] < 2 or not cfg["dflash_config"]["target_layer_ids"]:
        raise JetFlowError("export needs block_size >= 2 and at least one target layer")


def export_vllm(drafter: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16, target=None) -> Path:
    """Write ``out`` (config.json + model.safetensors) for ``vllm serve --speculative-config
    '{"method": "dflash", "model": OUT, "num_speculative_tokens": block_size - 1}'``. ``target`` (a
    loaded target or a model spec; default: the one named in the head's config) is loaded only for a
    reduced-vocabulary head, whose LM-head rows the export must carry."""
    head = load_drafter(drafter, dtype=torch.float32)
    reasons = unsupported(head.config)
    if reasons:
        raise JetFlowError(f"{drafter} cannot be exported to vLLM's DFlash format: " + "; ".join(reasons))
    lm_head = None
    if head.config.reduced_vocab:
        from jetflow.models.target import TargetModel

        if not isinstance(target, TargetBackend):
            target = TargetModel.load(target or head.config.target.get("name"))
        check_compatible(head.config, target)
        lm_head = target.lm_head_weight()
    cfg = vllm_config(head.config, dtype)
    state = vllm_state_dict(head, dtype, lm_head)
    validate(cfg, state)
    with replace_directory(Path(out), EXPORT_FILES) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    validate(json.loads((Path(out) / "config.json").read_text()), load_file(Path(out) / "model.safetensors"))
    return Path(out)


def speculative_config(export_dir: str | Path) -> dict:
    """vLLM's ``--speculative-config`` for an export: chain drafts of every depth the block holds."""
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    return {"method": "dflash", "model": str(export_dir), "num_speculative_tokens": cfg["block_size"] - 1}
