"""Batched attention over ragged sequences held in the slot cache, without copying K/V.

The rows of a step are split into groups (decodes, prefill chunks); for each group the
queries are laid out padded by slot, [slots, kv_heads, group * q_max, head_dim], so one
scaled_dot_product_attention call reads the cache's own slot rows as a view. Grouped-query
heads are folded into the query length, so K/V are never repeated per query head. A
boolean mask lets query (slot, i) see keys 0..position(slot, i); padding rows see key 0 and
are discarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    token_idx: torch.Tensor  # rows of the flat batch in this group
    q_row: torch.Tensor  # slot - slot_lo of each of those rows
    q_off: torch.Tensor  # offset of each row within its sequence's chunk
    slot_lo: int
    slot_hi: int
    q_max: int
    kv_len: int
    mask: torch.Tensor  # [slots, 1, q_per_kv * q_max, kv_len]


@dataclass
class AttentionMetadata:
    slot_ids: torch.Tensor  # [T] slot of each token
    groups: list[AttentionGroup]
    q_per_kv: int


def build_group(
    token_idx: list[int], slots: list[int], offsets: list[int], positions: list[int], q_per_kv: int, device: str
) -> AttentionGroup:
    """One group from per-row slot, offset within the chunk, and absolute position."""
    lo, hi = min(slots), max(slots) + 1
    q_max, kv_len = max(offsets) + 1, max(positions) + 1
    row = torch.tensor([s - lo for s in slots], device=device)
    off = torch.tensor(offsets, device=device)
    last_key = torch.zeros(hi - lo, q_max, dtype=torch.long, device=device)
    last_key[row, off] = torch.tensor(positions, device=device)
    mask = torch.arange(kv_len, device=device) <= last_key.unsqueeze(-1)  # [slots, q_max, kv_len]
    mask = mask.repeat(1, q_per_kv, 1).unsqueeze(1)
    return AttentionGroup(torch.tensor(token_idx, device=device), row, off, lo, hi, q_max, kv_len, mask)


def slot_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = num_heads // meta.q_per_kv
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for g in meta.groups:
        slots = g.slot_hi - g.slot_lo
        q_pad = q.new_zeros(slots, g.q_max, num_heads, head_dim)
        q_pad[g.q_row, g.q_off] = q[g.token_idx]
        q_pad = q_pad.view(slots, g.q_max, num_kv, meta.q_per_kv, head_dim).permute(0, 2, 3, 1, 4)
        q_pad = q_pad.reshape(slots, num_kv, meta.q_per_kv * g.q_max, head_dim)
        k = k_cache[g.slot_lo : g.slot_hi, :, : g.kv_len]
        v = v_cache[g.slot_lo : g.slot_hi, :, : g.kv_len]
        o = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=g.mask)
        o = o.view(slots, num_kv, meta.q_per_kv, g.q_max, head_dim).permute(0, 3, 1, 2, 4)
        out[g.token_idx] = o[g.q_row, g.q_off].reshape(-1, num_heads * head_dim)
    return out


# ---- the paged cache ---------------------------------------------------------------------


@dataclass
class PagedAttentionMetadata:
    """The paged cache's step layout. K/V are written at (block, offset); for attention, the
    step's sequences are numbered 0..n-1 (single-token rows first, so each group's sequences
    are contiguous) and their blocks gathered into a padded copy laid out like the slot cache,
    which `slot_attention` then reads with `dense` (its groups index those numbers)."""

    block_ids: torch.Tensor  # [T] block each token's K/V is written to
    block_offsets: torch.Tensor  # [T] its offset within that block
    block_tables: torch.Tensor  # [seqs, blocks] each sequence's blocks, padded
    dense: AttentionMetadata


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedAttentionMetadata
) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim]. The blocks are copied, not viewed (a
    paged-attention kernel would read them in place); the attention itself is the slot path's."""
    return slot_attention(
        q, gather_blocks(k_cache, meta.block_tables), gather_blocks(v_cache, meta.block_tables), meta.dense
    )


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[blocks, kv_heads, block_size, head_dim] through tables [seqs, n]
    -> [seqs, kv_heads, n * block_size, head_dim]."""
    seqs, n = tables.shape
    _, kv_heads, block_size, head_dim = cache.shape
    blocks = cache.index_select(0, tables.flatten()).view(seqs, n, kv_heads, block_size, head_dim)
    return blocks.transpose(1, 2).reshape(seqs, kv_heads, n * block_size, head_dim)
