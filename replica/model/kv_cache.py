"""The K/V caches: per layer, one preallocated K and one V tensor of shape
[rows, kv_heads, cols, head_dim], written in place at (row, col) by each step.

- `SlotKVCache`: a row per slot, [slots, kv_heads, max_seq_len, head_dim], written at
  (slot, position); a finished request's slot is simply reused by the next one, so joining
  and leaving cost nothing, but every slot sets aside max_seq_len tokens.
- `PagedKVCache`: a row per block, [blocks + 1, kv_heads, block_size, head_dim], written at
  (block, offset) through the request's block table (see `block_manager.py`), so memory is
  taken block by block as a request grows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.model.memory import empty_on_huge_pages
from replica.scheduling.request import Request
from replica.scheduling.scheduler import SchedulerConfig
from replica.scheduling.slot_table import SlotTable


@dataclass(frozen=True)
class KVCacheStats:
    slots_in_use: int
    tokens_held: int
    reserved_bytes: int  # what the slots in use set aside (max_seq_len each)
    used_bytes: int  # what their tokens actually occupy
    total_bytes: int  # the whole preallocated cache


class KVCache:
    """The tensors both layouts share, and the in-place write."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        cols: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ):
        shape = (rows, num_kv_heads, cols, head_dim)
        # One buffer for every layer, on huge pages: a step's attention reads each row's K/V from
        # places scattered over the whole cache (`replica.model.memory` says why that pays).
        # Zeros, not empty: padded attention rows read cache rows nobody wrote, and must see finite values.
        layers = empty_on_huge_pages((2 * num_layers, *shape), dtype, device).zero_()
        self.k, self.v = list(layers[:num_layers]), list(layers[num_layers:])
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * self.k[0].element_size()

    def write(self, layer: int, rows: torch.Tensor, cols: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim], token t going to (rows[t], cols[t])."""
        self.k[layer][rows, :, cols] = k
        self.v[layer][rows, :, cols] = v

    def places(self, request: Request, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, cols) of the request's positions [start, stop) in this layout."""
        raise NotImplementedError

    def read_tokens(self, request: Request, num_tokens: int) -> torch.Tensor:
        """A CPU copy of the K/V of the request's first `num_tokens` positions, token-major
        [2 (K, V), layers, tokens, kv_heads, head_dim] whatever the layout (a hand-over's)."""
        rows, cols = self.places(request, 0, num_tokens)
        return torch.stack([torch.stack([c[rows, :, cols] for c in cache]) for cache in (self.k, self.v)]).cpu()

    def kv_mismatch(self, kv: torch.Tensor) -> str | None:
        """Why K/V from `read_tokens` of another cache cannot be written here (None: they can;
        another dtype is converted)."""
        expected = (2, len(self.k), self.k[0].shape[1], self.k[0].shape[3])
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != expected:
            return f"K/V of shape {tuple(kv.shape)} do not fit this cache's (K/V, layers, heads, head_dim) {expected}"
        return None

    def write_tokens(self, request: Request, kv: torch.Tensor, start: int) -> None:
        """Write positions [start, tokens) of `kv` (as `read_tokens` gives it) into the
        request's rows of this cache; positions before `start` are already there."""
        rows, cols = self.places(request, start, kv.shape[2])
        part = kv[:, :, start:].to(device=self.k[0].device, dtype=self.k[0].dtype)
        for layer in range(len(self.k)):
            self.write(layer, rows, cols, part[0, layer], part[1, layer])

    def _positions(self, start: int, stop: int) -> torch.Tensor:
        return torch.arange(start, stop, device=self.k[0].device)


class SlotKVCache(KVCache):
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ):
        super().__init__(num_layers, num_slots, max_seq_len, num_kv_heads, head_dim, dtype, device)
        self.num_slots, self.max_seq_len = num_slots, max_seq_len

    def places(self, request: Request, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        cols = self._positions(start, stop)
        return torch.full_like(cols, request.slot), cols

    def mismatch(self, config: SchedulerConfig) -> str | None:
        """Why an engine with `config` cannot use this cache (None: it can)."""
        if config.kv_cache != "slot":
            return f"the runner's cache is a slot cache; this engine wants kv_cache={config.kv_cache!r}"
        if config.num_slots > self.num_slots or config.max_seq_len > self.max_seq_len:
            return (
                f"the runner's cache has {self.num_slots} slots of {self.max_seq_len} tokens; this engine "
                f"wants {config.num_slots} of {config.max_seq_len}"
            )
        return None

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


class PagedKVCache(KVCache):
    """`num_blocks` blocks for the block manager, and one more, `scratch_block`, that pads block
    tables and takes the K/V writes of rows whose result is thrown away (a static batch's held
    rows), so no such write lands in a block another request may share."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ):
        super().__init__(num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype, device)
        self.num_blocks, self.block_size, self.scratch_block = num_blocks, block_size, num_blocks

    def places(self, request: Request, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self._positions(start, stop)
        table = torch.tensor(request.block_table, dtype=torch.long, device=positions.device)
        return table[positions // self.block_size], positions % self.block_size

    def mismatch(self, config: SchedulerConfig) -> str | None:
        """Why an engine with `config` cannot use this cache (None: it can)."""
        if config.kv_cache != "paged":
            return f"the runner's cache is a paged cache; this engine wants kv_cache={config.kv_cache!r}"
        if config.block_size != self.block_size or config.num_blocks > self.num_blocks:
            return (
                f"the runner's cache has {self.num_blocks} blocks of {self.block_size} tokens; this engine "
                f"wants {config.num_blocks} of {config.block_size}"
            )
        return None
