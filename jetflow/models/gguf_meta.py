"""What the llama.cpp backend needs from a GGUF file besides llama.cpp itself: the architecture
numbers, the (dequantized) embedding and LM head the drafters share, and a transformers tokenizer
for the chat template.

Parsing a GGUF's metadata in Python takes seconds (every vocabulary entry is a field), so all of it
is read once and cached next to the torch backend's conversions:
``cache_root()/gguf/<stem>-<digest>/`` with ``meta.json``, ``embedding.npy`` (and ``lm_head.npy``
when the head is not tied) and the tokenizer files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from jetflow.errors import ModelResolutionError
from jetflow.models.backend import TargetShape
from jetflow.utils.fs import atomic_directory, cache_root, file_digest

# Architectures whose input embeddings are multiplied by sqrt(hidden) inside the model.
_SCALED_EMBEDDINGS = ("gemma", "gemma2", "gemma3")


def gguf_sidecar(gguf: Path) -> Path:
    """The cache directory for ``gguf`` (built on first use)."""
    gguf = Path(gguf).resolve()
    out = cache_root() / "gguf" / f"{gguf.stem}-{file_digest(gguf)}"
    if (out / "meta.json").is_file():
        return out
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ModelResolutionError(f"reading {gguf.name} needs an extra package: {e}") from e
    try:
        reader = GGUFReader(gguf)
        fields = {k: f.contents() for k, f in reader.fields.items()
                  if not k.startswith(("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                                       "tokenizer.ggml.scores"))}
        tensors = {t.name: t for t in reader.tensors}
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        raise ModelResolutionError(f"could not read GGUF file {gguf}: {e}") from e
    arch = fields["general.architecture"]

    def weight(name: str) -> np.ndarray:
        t = tensors[name]
        return np.ascontiguousarray(dequantize(t.data, t.tensor_type).astype(np.float32))

    meta = {"architecture": arch, "file_type": _file_type_name(fields.get("general.file_type")),
            "fields": {k: v for k, v in fields.items() if k.startswith(arch + ".")},
            "tied_lm_head": "output.weight" not in tensors}
    with atomic_directory(out) as tmp:
        np.save(tmp / "embedding.npy", weight("token_embd.weight"))
        if not meta["tied_lm_head"]:
            np.save(tmp / "lm_head.npy", weight("output.weight"))
        tokenizer.save_pretrained(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    return out


def _file_type_name(code) -> str:
    if code is None:
        return "unknown"
    try:
        from gguf import LlamaFileType

        return LlamaFileType(int(code)).name.removeprefix("MOSTLY_")
    except (ImportError, ValueError):
        return str(code)


def _meta(gguf: Path) -> dict:
    return json.loads((gguf_sidecar(gguf) / "meta.json").read_text())


def gguf_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_sidecar(gguf))


def gguf_file_type(gguf: Path) -> str:
    return _meta(gguf)["file_type"]


def gguf_shape(gguf: Path, vocab_size: int) -> TargetShape:
    meta = _meta(gguf)
    arch, f = meta["architecture"], meta["fields"]

    def get(key, default=None):
        value = f.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelResolutionError(f"{gguf.name} has no {arch}.{key} in its metadata")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    return TargetShape(
        model_type=arch, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)), vocab_size=vocab_size,
        num_hidden_layers=int(get("block_count")), rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)))


def gguf_output_weights(gguf: Path, shape: TargetShape) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding matrix as the model applies it, LM head) [V, H] float32."""
    side = gguf_sidecar(gguf)
    table = torch.from_numpy(np.load(side / "embedding.npy"))
    lm_head = table if _meta(gguf)["tied_lm_head"] else torch.from_numpy(np.load(side / "lm_head.npy"))
    if shape.model_type in _SCALED_EMBEDDINGS:
        table = table * shape.hidden_size ** 0.5
    return table, lm_head
