"""Linear layers over a few rows, computed as W @ x^T where the CPU's BLAS does that faster.

A tree verify multiplies every weight matrix by a few rows (its nodes). PyTorch computes x @ W^T;
with the MKL it ships for x86, on an AMD EPYC (AVX2) that product takes about twice as long for 2
rows as for 1 and runs at 5-15 GFLOP/s up to 17 rows, while the same numbers as W @ x^T come
2-3x faster there (SmolLM2's LM head, 49152 x 576: 31 ms for 2 rows against 12 ms; a verify of
2-17 tokens in 0.66-0.82x the time; ``python benchmarks/few_row_linear.py``). One row is a
matrix-vector product either way and is left alone, and so are large batches (training, long
prefill chunks), where the two are level or the plain product wins.

The two forms differ only in the order BLAS sums the products, so rows come out equal up to float
rounding (last bits), as between any two BLAS calls. Whether W @ x^T is faster depends on the CPU
and its BLAS, so it is timed once per machine, model shape, dtype and thread count, and the
answer cached (``$JETFLOW_CACHE/linear_form``); ``JETFLOW_CPU_LINEAR=transposed|standard`` forces
one form.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from jetflow.utils.timing import median_ms

MAX_ROWS = 320  # above this the plain product is as fast or faster (measured up to 1024 rows)
PROBE_ROWS = (2, 16)  # the verify sizes `auto` picks on a CPU
FORMS = ("auto", "transposed", "standard")
ENV = "JETFLOW_CPU_LINEAR"


class FewRowLinear(nn.Linear):
    """An ``nn.Linear`` whose CPU forward over 2..MAX_ROWS rows computes W @ x^T (same weights, same
    state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = few_row_linear(x, self.weight, True)
        return y if self.bias is None else y + self.bias


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2D ``x``, as (W @ x^T)^T (a transposed view, no copy)."""
    y = torch.mm(weight, x.t()).t()
    return y if bias is None else y + bias


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``x @ weight.T`` for any leading shape, as :class:`FewRowLinear` computes it when ``transposed``."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not transposed or not 2 <= rows <= MAX_ROWS or x.device.type != "cpu":
        return F.linear(x, weight)
    return transposed_linear(x.reshape(rows, k), weight, None).reshape(*x.shape[:-1], weight.shape[0])


def requested_form() -> str:
    form = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if form not in FORMS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(FORMS)}")
    return form


def use_few_row_linear(model: nn.Module, cache_dir=None, form: str | None = None) -> str:
    """Switch the CPU model's linear layers to :class:`FewRowLinear` where W @ x^T is faster on
    this machine (or where ``JETFLOW_CPU_LINEAR`` or ``form`` asks), or back; returns the form in
    use, "transposed" or "standard"."""
    linears = [m for m in model.modules() if type(m) in (nn.Linear, FewRowLinear)]
    if not linears or linears[0].weight.device.type != "cpu":
        return "standard"
    form = requested_form() if form is None else form
    if form == "auto":
        form = "transposed" if cached_choice(linears, cache_dir) else "standard"
    for m in linears:
        m.__class__ = FewRowLinear if form == "transposed" else nn.Linear
    return form


def cached_choice(linears: list[nn.Linear], cache_dir=None) -> bool:
    """:func:`transposed_is_faster` once per machine, weight shapes, dtype and thread count."""
    from jetflow.eval.machine import cpu_name
    from jetflow.utils.fs import cache_root, write_json_atomic

    weights = probe_weights(linears)
    key = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "dtype": str(weights[0].dtype), "shapes": [list(w.shape) for w in weights], "rows": list(PROBE_ROWS),
           "max_rows": MAX_ROWS}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache_root() if cache_dir is None else cache_dir) / "linear_form" / f"{digest}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key and isinstance(stored.get("transposed"), bool):
            return stored["transposed"]
    except (OSError, json.JSONDecodeError, AttributeError):
        pass
    faster, times = transposed_is_faster(weights)
    write_json_atomic(path, {"key": key, "transposed": faster, "ms": times})
    return faster


def probe_weights(linears: list[nn.Linear]) -> list[torch.Tensor]:
    """The two largest distinct weight shapes (an LM head and an MLP projection, in a decoder)."""
    by_shape = {}
    for m in linears:
        by_shape.setdefault(tuple(m.weight.shape), m.weight)
    return sorted(by_shape.values(), key=lambda w: -w.numel())[:2]


@torch.inference_mode()
def transposed_is_faster(weights: list[torch.Tensor], reps: int = 5) -> tuple[bool, dict]:
    """Whether a :class:`FewRowLinear` beats an ``nn.Linear`` by 10% over ``weights`` at
    ``PROBE_ROWS`` rows (medians of ``reps`` after a warm-up), and the times in ms per form. The
    layers are timed as called, Python included: for a small model that overhead outweighs any gain
    in the product itself."""
    times = {"standard": 0.0, "transposed": 0.0}
    for w in weights:
        layers = {}
        for form, cls in (("standard", nn.Linear), ("transposed", FewRowLinear)):
            layers[form] = cls(w.shape[1], w.shape[0], bias=False, device="meta")
            layers[form].weight = nn.Parameter(w, requires_grad=False)  # the model's own weight, no copy
        for rows in PROBE_ROWS:
            x = torch.randn(1, rows, w.shape[1], dtype=w.dtype)
            for form, layer in layers.items():
                times[form] += median_ms(lambda: layer(x), reps)
    return times["transposed"] < 0.9 * times["standard"], times
