"""Batched attention over ragged sequences held in the slot cache.

The rows of a step are split into groups (decodes, prefill chunks); for each group the
queries are laid out padded by sequence, [seqs, kv_heads, group * q_max, head_dim], and one
scaled_dot_product_attention call reads K/V up to the group's longest live position (never a
slot's whole max_seq_len). Where the group's slots fill a contiguous range, K/V are the cache's
own slot rows as a view; where they are scattered (a few long requests left in a big cache),
only those slots' live ranges are gathered, so attention does not scan the empty slots between
them. Grouped-query heads are folded into the query length, so K/V are never repeated per query
head. A boolean mask lets query (seq, i) see keys 0..position(seq, i); padding rows see key 0
and are discarded.

Decode rows (one query row per sequence) on the CPU skip all of that where the caller asks
for it (`slot_attention(decode_kernel=True)`, decided once by the `Decoder`): `decode_attention`'s
kernel reads each row's own slot up to its own position, so no padding, mask or gathered copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replica.kernels import decode_attention as kernel

# Gather a group's slots when the slot range it spans is more than this many times its slot count
# (`build_group`'s default; a benchmark passes a huge spread to measure the range view alone).
GATHER_SPREAD = 2


@dataclass
class AttentionGroup:
    token_idx: torch.Tensor  # rows of the flat batch in this group
    q_row: torch.Tensor  # sequence (0..seqs-1) of each of those rows
    q_off: torch.Tensor  # offset of each row within its sequence's chunk
    slot_lo: int  # K/V: the slot range [slot_lo, slot_hi) as a view, or, where kv_slots is set, those slots
    slot_hi: int
    q_max: int
    kv_len: int
    mask: torch.Tensor | None  # [seqs, 1, q_per_kv * q_max, kv_len]; None: every query sees every key
    kv_slots: torch.Tensor | None = None  # [seqs] slots to gather (scattered groups only)
    # Decodes, one row per sequence: for the decode kernel each row's cache row (slot) and number
    # of keys (position + 1); where every sequence of the group has its row, also the rows in
    # sequence order (SDPA's layout without padded queries).
    seq_rows: torch.Tensor | None = None
    row_slots: torch.Tensor | None = None
    row_lengths: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.slot_hi - self.slot_lo if self.kv_slots is None else len(self.kv_slots)


@dataclass
class AttentionMetadata:
    slot_ids: torch.Tensor  # [T] slot of each token
    groups: list[AttentionGroup]
    q_per_kv: int


def build_group(
    token_idx: list[int],
    slots: list[int],
    offsets: list[int],
    positions: list[int],
    q_per_kv: int,
    device: str,
    gather_spread: int = GATHER_SPREAD,
) -> AttentionGroup:
    """One group from per-row slot, offset within the chunk, and absolute position; its slots
    are gathered when their range spans more than `gather_spread` times their count. Its index
    tensors are views of one buffer copied from Python once (each tensor made apart is a fixed
    host cost, every step), and the mask is built only where some query must not see a key."""
    lo, hi = min(slots), max(slots) + 1
    distinct = sorted(set(slots))
    gather = hi - lo > gather_spread * len(distinct)
    seq_of = {s: n for n, s in enumerate(distinct)} if gather else {s: s - lo for s in distinct}
    num_seqs = len(distinct) if gather else hi - lo
    q_max, kv_len = max(offsets) + 1, max(positions) + 1
    rows = [seq_of[s] for s in slots]
    # Decodes (one row per sequence): the kernel reads each row's own slot wherever it is; the
    # SDPA layout of one query row per sequence also needs every sequence of the range to have
    # its row (no slot between them idle or prefilling), which a cache whose requests end at
    # different steps seldom has.
    decodes = q_max == 1 and len(distinct) == len(slots)
    one_per_seq = decodes and len(slots) == num_seqs
    lists = [token_idx, rows, offsets, positions, distinct if gather else []]
    if decodes:  # each row's slot and number of keys
        lists += [slots, [p + 1 for p in positions]]
    if one_per_seq:  # the rows in sequence order
        lists.append([token_idx[i] for i in sorted(range(len(slots)), key=rows.__getitem__)])
    flat = torch.tensor([v for vs in lists for v in vs], dtype=torch.long, device=device)
    token_t, row, off, pos, kv_slots, *decode = flat.split([len(vs) for vs in lists])
    row_slots = row_lengths = seq_rows = None
    if decodes:
        row_slots, row_lengths, *in_order = decode
        seq_rows = in_order[0] if in_order else None
    mask = None  # every query's keys are the whole range (decodes at one position)
    if not (one_per_seq and len(set(positions)) == 1):
        last_key = torch.zeros(num_seqs, q_max, dtype=torch.long, device=device)
        last_key[row, off] = pos
        mask = torch.arange(kv_len, device=device) <= last_key.unsqueeze(-1)  # [seqs, q_max, kv_len]
        mask = mask.repeat(1, q_per_kv, 1).unsqueeze(1)
    return AttentionGroup(
        token_t,
        row,
        off,
        lo,
        hi,
        q_max,
        kv_len,
        mask,
        kv_slots if gather else None,
        seq_rows,
        row_slots,
        row_lengths,
    )


def slot_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    decode_kernel: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim], written into `out` where given (every row
    of it: the groups cover the step's rows). decode_kernel: decode groups go through
    `decode_attention`'s kernel (the caller has checked it is available on q's device), the
    rest through SDPA."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv = num_heads // meta.q_per_kv
    if out is None:
        out = q.new_empty(num_tokens, num_heads * head_dim)
    for g in meta.groups:
        if decode_kernel and g.row_slots is not None:
            kernel.decode_attention(q, k_cache, v_cache, g.token_idx, g.row_slots, g.row_lengths, out)
            continue
        seqs = g.num_seqs
        if g.kv_slots is None:
            k = k_cache[g.slot_lo : g.slot_hi, :, : g.kv_len]
            v = v_cache[g.slot_lo : g.slot_hi, :, : g.kv_len]
        else:
            k = k_cache[:, :, : g.kv_len].index_select(0, g.kv_slots)
            v = v_cache[:, :, : g.kv_len].index_select(0, g.kv_slots)
        if g.seq_rows is not None:  # decodes: each sequence's one query row, its heads grouped by K/V head
            q_seq = q.index_select(0, g.seq_rows).view(seqs, num_kv, meta.q_per_kv, head_dim)
            o = F.scaled_dot_product_attention(q_seq, k, v, attn_mask=g.mask)
            out.index_copy_(0, g.seq_rows, o.reshape(seqs, num_heads * head_dim))
            continue
        q_pad = q.new_zeros(seqs, g.q_max, num_heads, head_dim)
        q_pad[g.q_row, g.q_off] = q[g.token_idx]
        q_pad = q_pad.view(seqs, g.q_max, num_kv, meta.q_per_kv, head_dim).permute(0, 2, 3, 1, 4)
        q_pad = q_pad.reshape(seqs, num_kv, meta.q_per_kv * g.q_max, head_dim)
        o = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=g.mask)
        o = o.view(seqs, num_kv, meta.q_per_kv, g.q_max, head_dim).permute(0, 3, 1, 2, 4)
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
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    decode_kernel: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads * head_dim] (into `out` where given). The blocks are
    copied, not viewed (a paged-attention kernel would read them in place); the attention itself
    is the slot path's."""
    k, v = gather_blocks(k_cache, meta.block_tables), gather_blocks(v_cache, meta.block_tables)
    return slot_attention(q, k, v, meta.dense, decode_kernel, out)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[blocks, kv_heads, block_size, head_dim] through tables [seqs, n]
    -> [seqs, kv_heads, n * block_size, head_dim]."""
    seqs, n = tables.shape
    _, kv_heads, block_size, head_dim = cache.shape
    blocks = cache.index_select(0, tables.flatten()).view(seqs, n, kv_heads, block_size, head_dim)
    return blocks.transpose(1, 2).reshape(seqs, kv_heads, n * block_size, head_dim)
