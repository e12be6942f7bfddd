"""The model's matrix products: y = x W^T + b, with W prepacked for oneDNN where that pays, and an
optional weight-only int8 copy for steps with few rows.

Why: on these CPUs MKL's F.linear reaches a fraction of the machine on the skinny products of a
decode step (1-64 rows) and on the 49k-column LM head, while oneDNN with the weight reordered
once into its blocked layout reaches far more (HARDWARE.md, "What each optimisation bought"). It
is the kernel torch.compile's CPU freezing pass picks, without the compile. oneDNN packs fp32
weights on any x86 CPU and bf16 weights where the CPU has AVX-512 (with AVX512_BF16 or AMX it
uses them natively). On a GPU, or where oneDNN cannot pack, the plain F.linear is used.

A step with few rows is bound by reading the weights, not by arithmetic, so reading a quarter of
fp32's bytes (int8 with one scale per output row) can make it faster; a Linear built with
`int8_rows=N` keeps such a copy and uses it for steps of at most N rows, through
`replica.kernels.int8_matmul`'s kernel where it is built (`aten._weight_int8pack_mm` otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replica.kernels import int8_matmul

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
        self.int8_kernel = self.int8 is not None and int8_matmul.available(weight.device)
        self.packed = pack and can_pack(weight)
        # The packed copy replaces the plain one (a shared tensor, like a tied embedding, stays alive elsewhere).
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT) if self.packed else weight

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + b, plus `residual` where given (on a packed weight oneDNN adds it in the
        product's own pass: the layer's residual adds cost no pass of their own)."""
        if self.int8 is not None and x.shape[0] <= self.int8_rows:
            if self.int8_kernel:
                return int8_matmul.int8_linear(x, *self.int8, self.bias, residual)
            y = torch.ops.aten._weight_int8pack_mm(x, *self.int8)
            if self.bias is not None:
                y += self.bias
        elif self.packed and residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        elif self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if residual is None else y.add_(residual)
