"""Load a target on the backend the user asked for (``--backend {auto,torch,llamacpp}``).

``auto``: a GGUF target on the CPU runs on llama.cpp when its binding is installed (measured faster
on this project's reference machine: docs/results.md, "llama.cpp backend"); everything else --
Hugging Face directories and hub ids, GPUs, training -- runs on transformers.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from jetflow.errors import JetFlowError
from jetflow.models.backend import BACKENDS, TargetBackend


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def choose_backend(spec: str | None, backend: str, device: str | torch.device = "cpu") -> str:
    from jetflow.models.resolve import locate_gguf

    if backend not in BACKENDS:
        raise JetFlowError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend
    on_cpu = torch.device(device).type == "cpu"
    return "llamacpp" if on_cpu and llamacpp_available() and locate_gguf(spec) is not None else "torch"


def default_device_and_dtype(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                             backend: str = "auto") -> tuple[str | torch.device, torch.dtype]:
    """``device`` or cuda when there is one (and the backend is not llama.cpp, which runs on the
    CPU here), else cpu; ``dtype`` or float32 on the CPU, bfloat16 on a GPU (what the CLI and
    ``JetFlow.from_pretrained`` pick when not told)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() and backend != "llamacpp" else "cpu"
    else:
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as e:  # (a CPU-only torch asserts)
            raise JetFlowError(f"device {device!r} is not usable here: {e}") from None
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return device, dtype


def load_target(spec: str | None = None, *, backend: str = "auto", device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, tapped_layers: Sequence[int] | None = None,
                n_threads: int | None = None, flash_attn: bool = False) -> TargetBackend:
    """A target for any spec :func:`jetflow.resolve_model` accepts, on ``backend``. ``flash_attn``:
    llama.cpp's fused attention kernel (llama.cpp backend only; off by default: see README, Backends)."""
    from jetflow.models.resolve import locate_gguf

    chosen = choose_backend(spec, backend, device)
    if chosen == "torch":
        from jetflow.models.target import TargetModel

        return TargetModel.load(spec, device=device, dtype=dtype, tapped_layers=tapped_layers)
    if torch.device(device).type != "cpu":
        raise JetFlowError(f"the llama.cpp backend runs on the CPU here; device {device!r} needs --backend torch")
    located = locate_gguf(spec)
    if located is None:
        raise JetFlowError(f"the llama.cpp backend needs a GGUF file or a known short name, got {spec!r}; "
                           "use --backend torch for Hugging Face models")
    gguf, name = located
    from jetflow.models.gguf_meta import gguf_tokenizer
    from jetflow.models.llamacpp_target import LlamaCppTarget

    return LlamaCppTarget(gguf, gguf_tokenizer(gguf), name=name, tapped_layers=tapped_layers, n_threads=n_threads,
                          flash_attn=flash_attn)
