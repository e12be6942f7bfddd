"""Decode attention on the CPU as one small C++ kernel, built once with torch's C++ extension tools.

Why: a decode row has one query per head, and its sequence's K/V sit in the cache up to its
own position. torch's flash SDPA for the CPU handles such a row as a 3-query block (the
grouped heads) over a padded key range with a mask, and at 16-64 rows reaches a fraction of the
memory bandwidth that bounds this work (HARDWARE.md, "What each optimisation bought"). This
kernel reads each row's keys straight from its slot (no gathered copy of scattered slots, no
padding to the longest row, no mask), reads each key and value once for all the query heads
that share it (asking for the keys a few ahead: a step's rows are cold in the caches, written
steps ago), and runs rows and K/V heads in parallel on torch's threads. It accumulates in
fp32 for fp32 and bf16 caches alike.

Built by `replica.kernels.build` (once per CPU kind; `make setup` runs it). Where it cannot be
built, or off the CPU, `available()` is False and attention keeps to SDPA.
"""

from __future__ import annotations

import torch

from replica.kernels.build import CpuExtension

_EXTENSION = CpuExtension("decode_attention", ["decode_attention"])
available = _EXTENSION.available  # available(device): built here, and device is the CPU


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """For each i: out[rows[i]] = attention of q[rows[i]] ([heads, head_dim]) over the first
    lengths[i] keys and values of cache row slots[i] ([rows, kv_heads, cols, head_dim])."""
    _EXTENSION.module.decode_attention(q, k_cache, v_cache, rows, slots, lengths, q.shape[-1] ** -0.5, out)
