"""Matrix products for steps of a few rows (y = x W^T + b + r), as one C++ kernel built for this
CPU: dense fp32 and bf16 weights, and weight-only int8 copies.

Why: a decode step of one to a few rows reads every weight once and does little arithmetic with
it, so its time is the bytes it reads. oneDNN's packed product, tuned for larger steps, reads
them at a fraction of the memory bandwidth at one row, and torch's `_weight_int8pack_mm` runs at
a fraction of the fp32 product's speed on an AVX2-only CPU (HARDWARE.md, "What each optimisation
bought"). This kernel reads each weight row once for all the step's rows: blocks of 4 or 8 weight
rows at once, each against up to 4 of x's rows, so 8 to 16 independent sums keep the loads in
flight, with the rows a few blocks ahead prefetched; then the row's scale (int8), the bias and the
residual. The weight rows are split across torch's threads. Sums are fp32: bf16 pairs go through
AVX512_BF16's dot product (`_mm512_dpbf16_ps`), fp32 and int8 (widened to fp32) through AVX-512
or AVX2 FMAs. One template holds the blocking, tails, epilogue and threading; the weight types
differ only in their inner multiply-add. Dense weights are read in a layout of the kernel's own
(`dense_layout`: 8 rows interleaved by vectors), so each thread streams its share of a weight in
one sequential pass, which the hardware prefetcher follows; plain rows of a few hundred values
are 8 short strided streams it mostly does not. int8 copies stay plain row-major.

Built by `replica.kernels.build`; where it cannot be built, or off the CPU, `available()` is
False, and `dense_dtypes()` names the weight dtypes `dense_linear` serves on this build (bf16
only where the CPU has AVX512_BF16); `Linear` keeps to oneDNN and torch's operators elsewhere.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from replica.kernels.build import CpuExtension

_EXTENSION = CpuExtension("skinny_matmul", ["dense_layout", "dense_linear", "int8_linear", "dense_dtypes"])
available = _EXTENSION.available  # available(device): built here, and device is the CPU


@functools.cache
def source_hash() -> str:
    """A short hash of the kernel's source: a measurement of it (a crossover) holds for this source."""
    return hashlib.sha1(_EXTENSION.source_path.read_bytes()).hexdigest()[:8]


@functools.cache
def dense_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes `dense_linear` serves here (none where the kernel is not built)."""
    if _EXTENSION.module is None:
        return frozenset()
    return frozenset(getattr(torch, name) for name in _EXTENSION.module.dense_dtypes())


def serves_dense(weight: torch.Tensor) -> bool:
    """`dense_linear` is built here for this weight's dtype and device."""
    return available(weight.device) and weight.dtype in dense_dtypes()


@dataclass(frozen=True)
class DenseWeight:
    """A weight [N, K] as `dense_linear` reads it: blocked (8 rows interleaved by vectors, so a
    thread streams its rows in one pass) where its shape allows, else plain row-major."""

    data: torch.Tensor
    blocked: bool


def dense_layout(weight: torch.Tensor) -> DenseWeight:
    """`weight` [N, K] (a dtype `dense_dtypes()` names) laid out for `dense_linear`: a copy."""
    data, blocked = _EXTENSION.module.dense_layout(weight)
    return DenseWeight(data, blocked)


def dense_linear(
    x: torch.Tensor,
    weight: DenseWeight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] times a weight [N, K] of x's dtype laid out by `dense_layout`, plus `bias` and
    `residual` (in that dtype) where given: [M, N] in x's dtype."""
    return _EXTENSION.module.dense_linear(x, weight.data, weight.blocked, bias, residual)


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
