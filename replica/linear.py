"""The model's matrix products: y = x W^T + b, with W prepacked for oneDNN where that pays.

Why: on this CPU (AMD EPYC, AVX2, 2 threads) MKL's F.linear reaches 40-90 GFLOP/s on the
skinny products of a decode step (8-64 rows) and only 13-45 on the 49k-column LM head, while
oneDNN with the weight reordered once into its blocked layout reaches 75-130 (HARDWARE.md,
"What each optimisation bought"). It is the same kernel torch.compile's freezing pass picks
on CPU, without the compile. On a GPU, or where oneDNN cannot pack (bf16 without AVX-512),
the plain F.linear is used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The row count oneDNN tunes the packed layout for: a full decode batch of the default config.
PACK_ROWS_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing exists for fp32 weights on a CPU build with mkldnn."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Linear:
    """One weight matrix and its optional bias, called like F.linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.bias = bias
        self.packed = pack and can_pack(weight)
        # The packed copy replaces the plain one (a shared tensor, like a tied embedding, stays alive elsewhere).
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
