"""The slot K/V cache: per layer, one preallocated K and one V tensor of shape
[slots, kv_heads, max_seq_len, head_dim]. A step writes each new token's K/V in place at
(slot, position); a finished request's slot is simply reused by the next one, so joining
and leaving cost nothing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.slot_table import SlotTable


@dataclass(frozen=True)
class KVCacheStats:
    slots_in_use: int
    tokens_held: int
    reserved_bytes: int  # what the slots in use set aside (max_seq_len each)
    used_bytes: int  # what their tokens actually occupy
    total_bytes: int  # the whole preallocated cache


class SlotKVCache:
    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        shape = (num_slots, num_kv_heads, max_seq_len, head_dim)
        # Zeros, not empty: padded attention rows read slot rows nobody wrote, and must see finite values.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.k[0].element_size()

    def write(self, layer: int, slot_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim], token t going to (slot_ids[t], positions[t])."""
        self.k[layer][slot_ids, :, positions] = k
        self.v[layer][slot_ids, :, positions] = v

    def stats(self, slots: SlotTable) -> KVCacheStats:
        owners = [r for s in range(self.num_slots) if (r := slots.owner(s)) is not None]
        tokens = sum(r.num_computed_tokens for r in owners)
        return KVCacheStats(
            slots_in_use=len(owners),
            tokens_held=tokens,
            reserved_bytes=len(owners) * self.max_seq_len * self.bytes_per_token,
            used_bytes=tokens * self.bytes_per_token,
            total_bytes=self.num_slots * self.max_seq_len * self.bytes_per_token,
        )
