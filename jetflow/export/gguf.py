"""Export a JetFlow block head as a DFlash GGUF that llama.cpp's own speculative driver runs.

llama.cpp (the sources vendored in llama-cpp-python 0.3.36) has a ``dflash`` architecture: an
encoder pass fuses the target's tapped layer inputs (``fc`` -> ``enc.output_norm``) into the draft's
K/V cache, and a decoder pass runs the block ``[last token, MASK x (B-1)]`` through Qwen3-style
layers with the target's token embedding and, unless the draft ships its own, the target's LM head.
``dflash.attention.causal = true`` makes ``common/speculative.cpp`` keep the block causal, which is
what a JetFlow head was trained with. llama.cpp drafts a chain with it (no tree).

The weights are the ones the vLLM export writes (feature scale folded into ``fc``, the LM-head rows
of a reduced vocabulary), renamed to llama.cpp's tensor names. Differences from the HF layout that
matter: layer ids are stored +1 (llama.cpp taps layer *inputs*; input of layer i+1 = output of
layer i), ``d2t`` holds absolute target ids (HF stores offsets), and the tokenizer is copied from
the target's GGUF because llama.cpp needs a vocabulary in every model file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from jetflow.errors import JetFlowError
from jetflow.export.vllm import unsupported, vllm_state_dict
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead, check_compatible
from jetflow.utils.fs import atomic_path, check_writable_file

ARCH = "dflash"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# HF (DFlash) tensor name -> llama.cpp tensor name; per-layer names after "layers.N."
_GLOBAL_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
                 "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight", "d2t": "d2t"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise JetFlowError(f"no llama.cpp name for draft tensor {hf_name!r}")


def gguf_tensors(head: DraftHead, dtype: torch.dtype, lm_head_weight: torch.Tensor | None) -> dict[str, np.ndarray]:
    """llama.cpp name -> array. Matrices in ``dtype`` (norms stay float32, as ggml needs them)."""
    state = vllm_state_dict(head, torch.float32, lm_head_weight)
    out = {}
    for name, value in state.items():
        gname = gguf_tensor_name(name)
        if name == "d2t":  # offsets -> absolute target ids
            out[gname] = (value.long() + torch.arange(value.numel())).numpy().astype(np.int64)
        elif value.dim() == 1:
            out[gname] = value.float().numpy()
        elif dtype == torch.bfloat16:  # numpy has no bfloat16: store the raw 16 bits
            out[gname] = value.to(torch.bfloat16).view(torch.int16).numpy()
        else:
            out[gname] = value.to(dtype).numpy()
    return out


def _read_gguf(path: Path):
    """A ``gguf.GGUFReader`` of ``path``; JetFlowError when it is not a readable GGUF file."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # (the reader raises ValueError, OSError, ... on a cut or foreign file)
        raise JetFlowError(f"{path} is not a readable GGUF file: {e}") from None


def _copy_tokenizer(writer, target_gguf: Path) -> None:
    import gguf

    reader = _read_gguf(target_gguf)
    copied = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        copied += 1
    if not copied:
        raise JetFlowError(f"{target_gguf} has no tokenizer metadata to copy into the draft GGUF")


def target_gguf_for(spec: str | None) -> Path:
    """The GGUF file of a target given as a known model name or a .gguf path."""
    from jetflow.models.resolve import locate_gguf

    found = locate_gguf(spec) if spec else None
    if found is None:
        raise JetFlowError(f"export-gguf needs the target as a GGUF file (its tokenizer goes into the draft); "
                           f"{spec!r} is not one: pass --target path/to/model.gguf")
    return found[0]


def _check_target_gguf(config, target_gguf: Path) -> None:
    """Refuse a target GGUF whose sizes differ from the ones the head was built for."""
    reader = _read_gguf(target_gguf)
    if "general.architecture" not in reader.fields:
        raise JetFlowError(f"{target_gguf} has no general.architecture: not a model GGUF")
    arch = reader.fields["general.architecture"].contents()
    meta = {"hidden_size": f"{arch}.embedding_length", "num_hidden_layers": f"{arch}.block_count"}
    have = {k: reader.fields[v].contents() for k, v in meta.items() if v in reader.fields}
    if "tokenizer.ggml.tokens" in reader.fields:
        have["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    want = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "num_hidden_layers": config.target.get("num_hidden_layers")}
    problems = [f"{k}: head expects {want[k]}, {target_gguf.name} has {have[k]}"
                for k in want if want[k] is not None and k in have and int(have[k]) != int(want[k])]
    if problems:
        raise JetFlowError(f"{target_gguf} is not the head's target: " + "; ".join(problems))
    layers = int(have.get("num_hidden_layers") or want["num_hidden_layers"] or 0)
    last = [i for i in config.target_layer_ids if layers and i + 1 >= layers]
    if last:  # llama.cpp taps the input of layer i + 1: the last layer's output is not one
        raise JetFlowError(f"the head reads target layer(s) {last}, the target's last: llama.cpp can only give the "
                           f"outputs of layers 0..{layers - 2} (the inputs of the layers after them)")


def export_gguf(drafter: str | Path, out: str | Path, target_gguf: str | Path, dtype: str = "float16",
                target=None, overwrite: bool = False) -> Path:
    """Write ``out`` (one .gguf) for ``llama-speculative-simple -m TARGET.gguf -md OUT
    --spec-type draft-dflash``. ``target_gguf`` is the target's GGUF (tokenizer source); ``target``
    (a loaded backend, default: loaded from ``target_gguf``) is needed only for a reduced vocabulary,
    whose LM-head rows the draft must carry. An existing ``out`` is replaced only with ``overwrite``
    (a mistyped path must not turn a user's model into a draft head)."""
    import gguf

    if dtype not in DTYPES:
        raise JetFlowError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    target_gguf, out = Path(target_gguf), Path(out)
    if not target_gguf.is_file():
        raise JetFlowError(f"target GGUF not found: {target_gguf}")
    if out.suffix.lower() != ".gguf" or out.is_dir():
        raise JetFlowError(f"--out must be a .gguf file path, got {out}")
    if out.exists() and out.resolve() == target_gguf.resolve():
        raise JetFlowError(f"--out {out} is the target's own GGUF; refusing to overwrite it")
    check_writable_file(out)
    head = load_drafter(drafter, dtype=torch.float32)
    reasons = unsupported(head.config)
    if reasons:
        raise JetFlowError(f"{drafter} cannot be exported to llama.cpp's DFlash format: " + "; ".join(reasons))
    c = head.config
    _check_target_gguf(c, target_gguf)
    lm_head = None
    if c.reduced_vocab:
        if target is None:
            from jetflow.models.loading import load_target

            target = load_target(str(target_gguf), backend="auto")
        check_compatible(c, target)
        lm_head = target.lm_head_weight()
    if out.exists() and not overwrite:
        raise JetFlowError(f"--out {out} already exists; --overwrite (overwrite=True) replaces it")
    tensors = gguf_tensors(head, DTYPES[dtype], lm_head)

    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), ARCH)
        w.add_name(f"JetFlow {c.attention} block head for {c.target.get('name', 'target')}")
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_block_count(c.num_hidden_layers)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_dimension_count(c.head_dim)
        w.add_rope_freq_base(c.rope_theta)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_vocab_size(c.vocab_size)
        w.add_uint32(f"{ARCH}.block_size", c.block_size)
        w.add_bool(f"{ARCH}.attention.causal", c.attention == "causal")
        w.add_array(f"{ARCH}.target_layers", [i + 1 for i in c.target_layer_ids])
        _copy_tokenizer(w, target_gguf)
        w.add_uint32("tokenizer.ggml.mask_token_id", c.mask_token_id)
        for name, array in tensors.items():
            raw = gguf.GGMLQuantizationType.BF16 if array.dtype == np.int16 else None
            w.add_tensor(name, array, raw_dtype=raw)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out
