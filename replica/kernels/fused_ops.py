"""The small per-layer steps of a forward pass as C++ kernels, built once for this CPU.

Why: between its matrix products a layer ran about twenty small torch operators (slices, RoPE's
roll, multiply and add, two indexed cache writes, SiLU and a multiply, RMSNorm's five), each a
Python call and a dispatch, and each a pass over memory: at a decode step of a few rows, time
the matrix products did not use (HARDWARE.md, "What each optimisation bought"). Three kernels
take their place:

- `rope_write`: rotates Q and K in place in the fused QKV output (RoPE at each row's position;
  none for GPT-2) and writes K and V into the cache at each row's (cache row, column), which is
  (slot, position) in the slot cache and (block, offset) in the paged one;
- `silu_mul`: SiLU(gate) * up from the fused gate/up output, one pass;
- `rms_norm`: one pass per row (torch's CPU RMSNorm is five operators: pow, mean, add, rsqrt, mul).

And one for the sampler: `argmax`, each row's greedy token, vectorized (torch's CPU argmax is a
scalar loop over the vocabulary's logits, row after row).

The residual adds ride on the matrix products (oneDNN's add post-op, `Linear(x, residual=...)`).
Built by `replica.kernels.build`; where it cannot be built, or off the CPU, `available()` is
False and the model keeps to torch's operators.
"""

from __future__ import annotations

import torch

from replica.kernels.build import CpuExtension

_EXTENSION = CpuExtension("fused_ops", ["rope_write", "silu_mul", "rms_norm", "argmax"])
available = _EXTENSION.available  # available(device): built here, and device is the CPU


def rope_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    num_heads: int,
) -> None:
    """qkv: [T, (heads + 2 kv_heads) * head_dim], rotated in place at `positions` (cos, sin:
    [max_positions, head_dim] tables; None: no rotation); K and V of row t go to
    k_cache/v_cache[rows[t], :, cols[t]] ([cache rows, kv_heads, cols, head_dim])."""
    _EXTENSION.module.rope_write(qkv, positions, cos, sin, k_cache, v_cache, rows, cols, num_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: SiLU of the first half times the second."""
    return _EXTENSION.module.silu_mul(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, H] -> [T, H]: each row over its root mean square, times `weight`."""
    return _EXTENSION.module.rms_norm(x, weight, eps)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] float32 or bfloat16 -> [rows] int64, equal to `x.argmax(dim=-1)` (the first of
    equal maxima, or the first NaN)."""
    return _EXTENSION.module.argmax(x)
