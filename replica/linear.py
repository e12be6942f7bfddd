"""The model's matrix products: y = x W^T + b, with W prepacked for oneDNN where that pays, and an
optional weight-only int8 copy for steps with few rows.

Why: on these CPUs MKL's F.linear reaches a fraction of the machine on the skinny products of a
decode step (1-64 rows) and on the 49k-column LM head, while oneDNN with the weight reordered
once into its blocked layout reaches far more (HARDWARE.md, "What each optimisation bought"). It
is the kernel torch.compile's CPU freezing pass picks, without the compile. oneDNN packs fp32
weights on any x86 CPU and bf16 weights where the CPU has AVX-512 (with AVX512_BF16 or AMX it
uses them natively). On a GPU, or where oneDNN cannot pack, the plain F.linear is used.

A step with few rows is bound by reading the weights, not by arithmetic, so reading half the
bytes (int8 with one scale per output row, `aten._weight_int8pack_mm`) can make it faster; a
Linear built with `int8_rows=N` keeps such a copy and uses it for steps of at most N rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The row count oneDNN tunes the packed layout for: a full decode batch of the default config.
PACK_ROWS_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing exists for fp32 weights on a CPU build with mkldnn, and for bf16 ones where
    oneDNN has bf16 kernels for this CPU (AVX-512 and up)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: (int8 [N, K], scales [N] in the weight's dtype)."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(weight.dtype)


def can_int8(weight: torch.Tensor) -> bool:
    """`_weight_int8pack_mm` takes bf16 (or fp32) activations on the CPU."""
    return weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)


class Linear:
    """One weight matrix and its optional bias, called like F.linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True, int8_rows: int = 0):
        self.bias = bias
        self.int8_rows = int8_rows if can_int8(weight) else 0
        self.int8 = quantize_int8(weight) if self.int8_rows else None
        self.packed = pack and can_pack(weight)
        # The packed copy replaces the plain one (a shared tensor, like a tied embedding, stays alive elsewhere).
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None and x.shape[0] <= self.int8_rows:
            y = torch.ops.aten._weight_int8pack_mm(x, *self.int8)
            return y if self.bias is None else y + self.bias
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
