"""int8 weights for a drafter on the CPU (dynamic quantization: activations stay float and are
quantized per call). A draft forward is a handful of matmuls over 2-16 rows, where fp32 kernels
are bound by reading the weights; int8 reads a quarter of the bytes. Only the draft changes, never
what is accepted: verification still uses the target's own logits, so output stays lossless.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn


def _quantize(module: nn.Module) -> nn.Module:
    with warnings.catch_warnings():  # torch marks eager quantization deprecated; it is still the CPU int8 path
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8)


def int8_linears(module: nn.Module) -> nn.Module:
    """A copy of ``module`` (float32, CPU) whose ``nn.Linear`` layers run with int8 weights."""
    from jetflow.models.few_row_linear import use_few_row_linear

    twin = copy.deepcopy(module).float().cpu().eval()
    use_few_row_linear(twin, form="standard")  # FewRowLinear layers back to nn.Linear, which quantizes
    return _quantize(twin)


def int8_linear(weight: torch.Tensor) -> nn.Module:
    """x -> x @ weight.T with int8 weights (e.g. the drafter's slice of the shared LM head)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float().cpu())
    return _quantize(nn.Sequential(linear).eval())
