"""Runs one scheduler step on the real model: lays the step's rows out as one flat batch
(decode tokens, prefill chunks and static-batch padding rows together), runs one forward
pass over it, and samples a token for every sequence whose pending tokens are all in."""

from __future__ import annotations

import torch

from replica.config import EngineConfig, resolve_dtype
from replica.model.attention import (
    GATHER_SPREAD,
    AttentionGroup,
    AttentionMetadata,
    PagedAttentionMetadata,
    build_group,
)
from replica.model.decoder import Decoder
from replica.model.kv_cache import PagedKVCache, SlotKVCache
from replica.model.loader import load_hf_model
from replica.model.memory import return_freed_memory
from replica.model.sampler import Sampler
from replica.scheduling.request import Request
from replica.scheduling.scheduler import SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device(device: str) -> str:
    """ "auto" takes the GPU when there is one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class ModelRunner:
    def __init__(self, config: EngineConfig, gather_spread: int = GATHER_SPREAD):
        """The model of `config` on its device and dtype (with the C++ kernels it asks for), and a
        K/V cache for its slots (kv_cache "slot": num_slots rows of max_seq_len tokens; "paged":
        num_blocks blocks of block_size tokens, by default the same memory). gather_spread: see
        `attention.build_group` (a benchmark turns gathering off with a huge one)."""
        self.device = pick_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.gather_spread = gather_spread
        hf, self.tokenizer = load_hf_model(config.model, seed=config.seed)
        self.model = Decoder.from_hf(
            hf,
            DTYPES[self.dtype],
            self.device,
            int8_rows=config.int8_rows,
            fused_ops=config.fused_ops,
            decode_kernel=config.decode_kernel,
            skinny_matmul=config.skinny_matmul,
        )
        shape = self.model.shape
        self.vocab_size, self.max_model_len = shape.vocab_size, shape.max_positions
        eos = hf.generation_config.eos_token_id if hf.generation_config is not None else None
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = {t for t in (*eos, self.tokenizer.eos_token_id) if t is not None}
        del hf
        return_freed_memory()
        kv_shape = (shape.num_kv_heads, shape.head_dim, DTYPES[self.dtype], self.device)
        if config.kv_cache == "paged":
            self.cache: SlotKVCache | PagedKVCache = PagedKVCache(
                shape.num_layers, config.num_blocks, config.block_size, *kv_shape
            )
        else:
            self.cache = SlotKVCache(shape.num_layers, config.num_slots, config.max_seq_len, *kv_shape)
        self.sampler = Sampler(config.seed, self.eos_token_ids, kernel=self.model.fused_ops)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def _tensors(self, *values: list[int]) -> tuple[torch.Tensor, ...]:
        """The step's index lists as tensors made by one copy from Python (a buffer split into
        views), not one tensor per list: each torch.tensor call is a fixed host cost, paid
        again for every list of every step, and one host-to-device copy each on a GPU."""
        flat = [v for vs in values for v in vs]
        return torch.tensor(flat, dtype=torch.long, device=self.device).split([len(vs) for vs in values])

    def execute(self, out: SchedulerOutput) -> list[int]:
        """One forward pass; returns one token per chunk with `samples`, in chunk order."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        single: list[bool] = []  # the row is its sequence's only one this step (a decode, say)
        logit_rows: list[int] = []
        sampled: list[Request] = []
        for chunk in out.chunks:
            r, start, n = chunk.request, chunk.start, chunk.num_tokens
            ids += r.token_ids(start, start + n)
            if n == 1:  # a decode's row: no ranges built for it
                positions.append(start)
                slots.append(r.slot)
                offsets.append(0)
                single.append(True)
            else:
                positions += range(start, start + n)
                slots += [r.slot] * n
                offsets += range(n)
                single += [False] * n
            if chunk.samples:
                logit_rows.append(len(ids) - 1)
                sampled.append(r)
        num_useful = len(ids)  # rows after these are a static batch's held rows
        for held in out.held_rows:
            # Padding: recompute the row's last token in place (same K/V, same value), as a
            # padded static batch would, and throw the result away.
            last = held.num_computed_tokens - 1
            if last >= 0:
                ids += held.token_ids(last, last + 1)
                positions.append(last)
                slots.append(held.slot)
                offsets.append(0)
                single.append(True)
        q_per_kv = self.model.shape.num_heads // self.model.shape.num_kv_heads
        if isinstance(self.cache, PagedKVCache):
            owners = [c.request for c in out.chunks] + list(out.held_rows)
            ids_t, positions_t, logit_rows_t, meta = self._paged_metadata(
                ids, logit_rows, owners, slots, positions, offsets, single, num_useful, q_per_kv
            )
        else:
            ids_t, positions_t, logit_rows_t, slots_t = self._tensors(ids, positions, logit_rows, slots)
            meta = AttentionMetadata(slots_t, self._groups(slots, offsets, positions, single, q_per_kv), q_per_kv)
        logits = self.model.forward(ids_t, positions_t, meta, self.cache, logit_rows_t)
        return self.sampler.sample(logits, sampled)

    def _groups(
        self, seqs: list[int], offsets: list[int], positions: list[int], single: list[bool], q_per_kv: int
    ) -> list[AttentionGroup]:
        """Two attention groups, so single-token rows are not padded to a long prefill chunk
        (one where every row is of one kind: the step's own lists, not copies of them).
        seqs: each row's sequence (its slot, or its number in the paged cache's gathered copy)."""
        groups = []
        for flag in (True, False):
            rows = [i for i, s in enumerate(single) if s is flag]
            if len(rows) == len(single):
                return [build_group(rows, seqs, offsets, positions, q_per_kv, self.device, self.gather_spread)]
            if rows:
                picked = ([seqs[i] for i in rows], [offsets[i] for i in rows], [positions[i] for i in rows])
                groups.append(build_group(rows, *picked, q_per_kv, self.device, self.gather_spread))
        return groups

    def _paged_metadata(
        self,
        ids: list[int],
        logit_rows: list[int],
        owners: list[Request],
        slots: list[int],
        positions: list[int],
        offsets: list[int],
        single: list[bool],
        num_useful: int,
        q_per_kv: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMetadata]:
        """The ids, positions and logit rows as tensors (one buffer with the rest), and where
        each row writes (block, offset) and how the step's sequences' blocks are gathered. Held
        rows write to the scratch block: their result is thrown away, and their last block may
        be a full one other requests share."""
        block_size, scratch = self.cache.block_size, self.cache.scratch_block
        by_slot = {r.slot: r for r in owners}
        single_of = dict(zip(slots, single))
        order = sorted(single_of, key=lambda s: (not single_of[s], s))  # each group's sequences contiguous
        number = {s: n for n, s in enumerate(order)}
        width = -(-(max(positions) + 1) // block_size)
        tables = [by_slot[s].block_table[:width] for s in order]
        block_ids = [
            by_slot[s].block_table[p // block_size] if i < num_useful else scratch
            for i, (s, p) in enumerate(zip(slots, positions))
        ]
        seqs = [number[s] for s in slots]
        padded = [b for t in tables for b in t + [scratch] * (width - len(t))]
        ids_t, positions_t, logit_rows_t, block_ids_t, offsets_t, tables_t, seqs_t = self._tensors(
            ids, positions, logit_rows, block_ids, [p % block_size for p in positions], padded, seqs
        )
        dense = AttentionMetadata(seqs_t, self._groups(seqs, offsets, positions, single, q_per_kv), q_per_kv)
        return (
            ids_t,
            positions_t,
            logit_rows_t,
            PagedAttentionMetadata(block_ids_t, offsets_t, tables_t.view(len(tables), width), dense),
        )
