"""Weight-only int8 matrix products for steps of a few rows, as one C++ kernel built for this CPU.

Why: a decode step of one to a few rows reads every weight once and does little arithmetic with
it, so its time is the bytes it reads: int8 weights are a quarter of fp32's. torch's own
`_weight_int8pack_mm` serves that on AVX-512 CPUs but on an AVX2-only one runs at a fraction of
the fp32 product's speed (HARDWARE.md, "What each optimisation bought"). This kernel reads each
weight row once for all the step's rows (widening 8 int8 values at a time to fp32 and
multiplying them into up to 8 rows' sums), scales by the row's scale, adds the bias and the
residual, and splits the weight rows across torch's threads. Activations may be fp32 or bf16;
sums are fp32.

Built by `replica.kernels.build`; where it cannot be built, or off the CPU, `available()` is
False and `Linear` keeps to torch's operators.
"""

from __future__ import annotations

import torch

from replica.kernels.build import CpuExtension

_EXTENSION = CpuExtension("int8_matmul", ["int8_linear"])
available = _EXTENSION.available  # available(device): built here, and device is the CPU


def int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32 or bf16) times int8 q [N, K] scaled per row by `scales`, plus `bias` and
    `residual` where given: [M, N] in x's dtype."""
    return _EXTENSION.module.int8_linear(x, q, scales, bias, residual)
