"""Linear layers over a few rows, computed as W @ x^T where the CPU's BLAS does that faster.

A tree verify multiplies every weight matrix by a few rows (its nodes). PyTorch computes x @ W^T;
with the MKL it ships for x86, on an AMD EPYC (AVX2) that product takes about twice as long for 2
rows as for 1 and runs at 5-15 GFLOP/s up to 17 rows, while the same numbers as W @ x^T come
2-3x faster there (SmolLM2's LM head, 49152 x 576: 31 ms for 2 rows against 12 ms; a verify of
2-17 tokens in 0.66-0.82x the time; ``python benchmarks/few_row_linear.py``). Large batches
(training, long prefill chunks) are left alone: there the two are level or the plain product wins.

One row (a plain decoding step) is a matrix-vector product, and some CPUs run that on one core:
on an AMD EPYC with AVX-512 all of SmolLM2's products took 44.8 ms for one row and 19.3 ms for
the row as two (``python benchmarks/few_row_linear.py``, "streamed"). There the "paired" form computes one row as two (the row and a copy) and keeps the
first; elsewhere one row is left alone.

The forms differ only in the order BLAS sums the products, so rows come out equal up to float
rounding (last bits), as between any two BLAS calls. Which form is fastest depends on the CPU and
its BLAS, so it is timed once per machine, model shape, dtype and thread count, and the answer
cached (``$JETFLOW_CACHE/linear_form``); ``JETFLOW_CPU_LINEAR=paired|transposed|standard`` forces
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
FORMS = ("auto", "paired", "transposed", "standard")
ENV = "JETFLOW_CPU_LINEAR"


class FewRowLinear(nn.Linear):
    """An ``nn.Linear`` whose CPU forward over 2..MAX_ROWS rows computes W @ x^T (same weights, same
    state dict)."""

    paired = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = few_row_linear(x, self.weight, True, self.paired)
        return y if self.bias is None else y + self.bias


class PairedRowLinear(FewRowLinear):
    """A :class:`FewRowLinear` that also computes one row as two (for a BLAS whose matrix-vector
    product runs on one core)."""

    paired = True


LAYERS = {"standard": nn.Linear, "transposed": FewRowLinear, "paired": PairedRowLinear}


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2D ``x``, as (W @ x^T)^T (a transposed view of the product).

    ``x`` is made contiguous first: the previous layer's output is such a transposed view, and
    elementwise ops keep its layout, so an MLP's down projection would get x^T in row-major order,
    which MKL multiplies several times slower (on an AVX-512 EPYC a 2-token verify took 46.6 ms
    without this copy and 32.1 ms with it). The copy is a few rows."""
    y = torch.mm(weight, x.contiguous().t()).t()
    return y if bias is None else y + bias


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool, paired: bool = False) -> torch.Tensor:
    """``x @ weight.T`` for any leading shape, as :class:`FewRowLinear` (or, ``paired``,
    :class:`PairedRowLinear`) computes it when ``transposed``."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not transposed or x.device.type != "cpu" or not (1 if paired else 2) <= rows <= MAX_ROWS:
        return F.linear(x, weight)
    flat = x.reshape(rows, k)
    if rows == 1:  # a copy, not an expanded view: BLAS takes a stride-0 operand down a slow path
        y = transposed_linear(torch.cat([flat, flat]), weight, None)[:1]
    else:
        y = transposed_linear(flat, weight, None)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def requested_form() -> str:
    form = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if form not in FORMS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(FORMS)}")
    return form


def use_few_row_linear(model: nn.Module, cache_dir=None, form: str | None = None) -> str:
    """Switch the CPU model's linear layers to the fastest form on this machine (or the one
    ``JETFLOW_CPU_LINEAR`` or ``form`` asks for), or back; returns the form in use: "paired",
    "transposed" or "standard"."""
    linears = [m for m in model.modules() if type(m) in LAYERS.values()]
    if not linears or linears[0].weight.device.type != "cpu":
        return "standard"
    form = requested_form() if form is None else form
    if form == "auto":
        form = cached_choice(linears, cache_dir)
    for m in linears:
        m.__class__ = LAYERS[form]
    return form


def cached_choice(linears: list[nn.Linear], cache_dir=None) -> str:
    """:func:`fastest_form` once per machine, weight shapes, dtype and thread count."""
    from jetflow.eval.machine import cpu_name
    from jetflow.utils.fs import cache_root, write_json_atomic

    weights = probe_weights(linears)
    key = {"cpu": cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "dtype": str(weights[0].dtype), "shapes": [list(w.shape) for w in weights], "rows": list(PROBE_ROWS),
           "max_rows": MAX_ROWS, "forms": list(LAYERS)}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (cache_root() if cache_dir is None else cache_dir) / "linear_form" / f"{digest}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key and stored.get("form") in LAYERS:
            return stored["form"]
    except (OSError, json.JSONDecodeError, AttributeError):
        pass
    form, times = fastest_form(weights)
    write_json_atomic(path, {"key": key, "form": form, "ms": times})
    return form


def probe_weights(linears: list[nn.Linear]) -> list[torch.Tensor]:
    """The two largest distinct weight shapes (an LM head and an MLP projection, in a decoder)."""
    by_shape = {}
    for m in linears:
        by_shape.setdefault(tuple(m.weight.shape), m.weight)
    return sorted(by_shape.values(), key=lambda w: -w.numel())[:2]


@torch.inference_mode()
def fastest_form(weights: list[torch.Tensor], reps: int = 5) -> tuple[str, dict]:
    """The form to use over ``weights`` and the times in ms it was chosen by (medians of ``reps``
    after a warm-up): "transposed" where it beats ``nn.Linear`` by 10% at ``PROBE_ROWS`` rows, and
    "paired" where, besides, one row computed as two beats one row by 10%. The layers are timed as
    called, Python included: for a small model that overhead outweighs any gain in the product."""
    times = {"standard": 0.0, "transposed": 0.0, "standard_one_row": 0.0, "paired_one_row": 0.0}
    for w in weights:
        layers = {}
        for form, cls in LAYERS.items():
            layers[form] = cls(w.shape[1], w.shape[0], bias=False, device="meta")
            layers[form].weight = nn.Parameter(w, requires_grad=False)  # the model's own weight, no copy
        for rows in PROBE_ROWS:
            x = torch.randn(1, rows, w.shape[1], dtype=w.dtype)
            for form in ("standard", "transposed"):
                times[form] += median_ms(lambda: layers[form](x), reps)
        x = torch.randn(1, 1, w.shape[1], dtype=w.dtype)
        for form in ("standard", "paired"):
            times[f"{form}_one_row"] += median_ms(lambda: layers[form](x), reps)
    if times["transposed"] >= 0.9 * times["standard"]:
        return "standard", times
    return ("paired" if times["paired_one_row"] < 0.9 * times["standard_one_row"] else "transposed"), times
