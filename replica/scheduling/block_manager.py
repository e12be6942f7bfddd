"""The paged K/V cache's bookkeeping: fixed-size blocks with reference counts, a block table
per request, and optional prefix sharing, after nano-vllm's block manager and vLLM's prefix
cache. Pure Python (no torch): the tensors live in `kv_cache.PagedKVCache`.

A request takes blocks as it grows instead of a whole max_seq_len row up front, so at the same
K/V budget many more requests fit, and at most one partly filled block per request is wasted.
With prefix caching, a full block whose K/V are computed is filed under a hash chained over
all blocks before it (`protocol.blocks`, so equal hashes mean equal whole prefixes, not just
equal blocks, and a router's index names them the same way); a later request whose leading
blocks hash the same takes those blocks by reference (ref_count += 1) and skips computing them.
Shared blocks are full and never written again: a request only writes at positions past the
tokens it has computed. A cached block whose last user ends stays in the cache, free but
reusable, until its memory is needed (least recently freed first).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from protocol.blocks import NO_PARENT, chain
from protocol.messages import KvEvents
from replica.errors import InvariantViolation
from replica.scheduling.kv_events import KvEventBuffer
from replica.scheduling.request import Request
from replica.scheduling.slot_table import SlotTable


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is in the prefix cache
    token_ids: tuple[int, ...] = ()  # its tokens while cached: a hit compares them, so a hash collision cannot alias


class BlockManager:
    """Owns the blocks and nothing else: yes/no questions, allocation, reference counts."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks (ref 0): plain ones are handed out first (a stack, lowest id on top); cached
        # ones only when no plain one is left, least recently freed first, which evicts them.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: dict[int, None] = {}  # an ordered set: insertion order is eviction order
        self._cached: dict[int, int] = {}  # chained hash -> id of the block holding that prefix's last block
        # what entered and left the prefix cache since the last load report (a router indexes it)
        self.kv_events = KvEventBuffer(self.cached_hashes) if prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix sharing --------------------------------------------------------------------
    def prefix_hits(self, request: Request) -> list[int]:
        """Cached blocks equal to the request's leading full blocks. It stops before the block
        holding the request's last token: that token is always computed, so it can sample."""
        if not self.prefix_caching:
            return []
        hits = []
        for i, h in enumerate(self._hashes(request, (request.num_tokens - 1) // self.block_size)):
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(request, i):
                break
            hits.append(block_id)
        return hits

    def cache_computed(self, request: Request) -> None:
        """File the request's full blocks whose K/V are computed in the prefix cache. Called when
        the scheduler next touches the request (reserve, release): only then are the tokens of
        the last step known to be in the cache, so no one can hit a block still being written."""
        if not self.prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        for i, (block_id, h) in enumerate(zip(request.block_table, self._hashes(request, num_full))):
            block = self.blocks[block_id]
            if block.hash is None and h not in self._cached:  # a duplicate of a cached block stays private
                block.hash, block.token_ids = h, self._block_tokens(request, i)
                self._cached[h] = block_id
                self.kv_events.stored(h)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (they become plain free blocks), so what
        comes next finds none of what came before; blocks in use stay cached. Returns how many
        were forgotten."""
        forgotten = list(self._free_cached)
        for block_id in forgotten:
            self._uncache(self.blocks[block_id])
        self._free_cached.clear()
        self._free.extend(reversed(forgotten))
        return len(forgotten)

    def cached_hashes(self) -> list[int]:
        """Every hash in the prefix cache, the next to be evicted first and blocks in use last
        (the order a snapshot of it is sent in)."""
        free = [self.blocks[b].hash for b in self._free_cached]
        return free + [h for h, b in self._cached.items() if self.blocks[b].ref_count > 0]

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """The chained hashes (`protocol.blocks`: what a client sends and a router indexes) of
        the request's first `num_blocks` full blocks, memoised on the request (its tokens are
        append-only, so they never go stale, even across preemption)."""
        hashes = request.block_hashes
        while len(hashes) < num_blocks:
            hashes.append(chain(hashes[-1] if hashes else NO_PARENT, self._block_tokens(request, len(hashes))))
        return hashes[:num_blocks]

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        return tuple(request.token_ids(index * self.block_size, (index + 1) * self.block_size))

    # ---- allocation --------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """Room for a new request's first `num_tokens` tokens, its prefix hits included (a hit on a
        free cached block takes that block off the free list)."""
        hits = self.prefix_hits(request)
        revived = sum(self.blocks[b].ref_count == 0 for b in hits)
        return self.blocks_for(num_tokens) - len(hits) + revived <= self.num_free_blocks

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Give a new request its prefix hits, then fresh blocks up to `num_tokens` tokens."""
        if request.block_table:
            raise InvariantViolation(
                f"allocate() for {request.request_id}, which already has blocks {request.block_table}"
            )
        for block_id in self.prefix_hits(request):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
            request.block_table.append(block_id)
        if not self.grow(request, num_tokens):
            raise InvariantViolation(f"allocate({request.request_id}, {num_tokens}) without the free blocks for it")

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Extend the request's table to hold `num_tokens` tokens; False (and nothing taken) if
        the free blocks cannot cover it. Idempotent, like SlotTable.reserve."""
        need = self.blocks_for(num_tokens) - len(request.block_table)
        if need > self.num_free_blocks:
            return False
        request.block_table.extend(self._take_free() for _ in range(need))
        return True

    def _take_free(self) -> int:
        if self._free:
            block_id = self._free.pop()
        else:  # evict the least recently freed cached block
            block_id = next(iter(self._free_cached))
            del self._free_cached[block_id]
            self._uncache(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        """Take a free block out of the prefix cache (its caller drops it from `_free_cached`)."""
        del self._cached[block.hash]
        self.kv_events.removed(block.hash)
        block.hash, block.token_ids = None, ()

    def free(self, request: Request) -> None:
        """Drop the request's references. Its last blocks go on the free lists first, so a cached
        prefix is evicted from its tail, and its head (the most shareable part) lasts longest."""
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free.append(block_id)
                else:
                    self._free_cached[block_id] = None
        request.block_table.clear()

    def check_invariants(self, requests: list[Request]) -> None:
        """Reference counts equal the tables that hold each block; the free lists hold exactly the
        unreferenced blocks, once each; the prefix cache and the blocks agree."""
        refs = Counter(b for r in requests for b in r.block_table)
        for r in requests:
            if len(set(r.block_table)) != len(r.block_table):
                raise InvariantViolation(f"{r.request_id} holds a block twice: {r.block_table}")
        for block in self.blocks:
            if block.ref_count != refs[block.block_id]:
                raise InvariantViolation(
                    f"block {block.block_id} has ref_count {block.ref_count} but is in {refs[block.block_id]} tables"
                )
        free = [*self._free, *self._free_cached]
        if len(set(free)) != len(free):
            raise InvariantViolation(f"a block is free twice: {sorted(free)}")
        unreferenced = {b.block_id for b in self.blocks if b.ref_count == 0}
        if set(free) != unreferenced:
            raise InvariantViolation(f"free blocks {sorted(free)} != unreferenced blocks {sorted(unreferenced)}")
        if any(self.blocks[b].hash is not None for b in self._free) or any(
            self.blocks[b].hash is None for b in self._free_cached
        ):
            raise InvariantViolation("a plain free block is cached, or a cached free block is not")
        cached = {b.hash: b.block_id for b in self.blocks if b.hash is not None}
        if cached != self._cached:
            raise InvariantViolation(f"prefix cache {self._cached} disagrees with the blocks' hashes {cached}")


class PagedSlotTable(SlotTable):
    """The slot table's interface over a BlockManager, so the scheduler runs unchanged. Slots
    stay as sequence ids (a row of the batch; num_slots still caps concurrency), but K/V is
    reserved a block at a time as a request grows, not max_seq_len per slot up front."""

    def __init__(
        self, num_slots: int, max_seq_len: int, num_blocks: int, block_size: int, prefix_caching: bool = False
    ):
        super().__init__(num_slots, max_seq_len, num_blocks * block_size)
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)

    def cached_prefix_tokens(self, request: Request) -> int:
        return len(self.blocks.prefix_hits(request)) * self.block_size

    def shared_prefix_tokens(self, request: Request) -> int:
        cached = [self.blocks.blocks[b].hash is not None for b in request.block_table]
        return (cached.index(False) if False in cached else len(cached)) * self.block_size

    def reset_prefix_cache(self) -> int:
        return self.blocks.reset_prefix_cache()

    def take_kv_events(self) -> KvEvents | None:
        return None if self.blocks.kv_events is None else self.blocks.kv_events.take()

    def request_kv_snapshot(self) -> bool:
        if self.blocks.kv_events is None:
            return False
        self.blocks.kv_events.request_snapshot()
        return True

    def can_admit(self, request: Request, num_tokens: int) -> bool:
        return bool(self._free) and self.blocks.can_allocate(request, num_tokens)

    def admit(self, request: Request, num_tokens: int) -> None:
        """Take a slot, the request's prefix hits (`cached_prefix_tokens` of them) and blocks up
        to `num_tokens` tokens."""
        self._take_slot(request, num_tokens)
        self.blocks.allocate(request, num_tokens)
        self._count_used()

    def reserve(self, request: Request, total_tokens: int) -> bool:
        self._check_reserve(request, total_tokens)
        self.blocks.cache_computed(request)
        fits = self.blocks.grow(request, total_tokens)
        self._count_used()
        return fits

    def release(self, request: Request) -> None:
        self._check_owner(request, "release")
        self.blocks.cache_computed(request)
        self.blocks.free(request)
        self._count_used()
        self._free_slot(request)

    def _count_used(self) -> None:
        self.used_kv_tokens = self.blocks.num_used_blocks * self.block_size

    def check_invariants(self) -> None:
        self._check_slots()
        owners = list(self._owner.values())
        self.blocks.check_invariants(owners)
        if self.used_kv_tokens != self.blocks.num_used_blocks * self.block_size:
            raise InvariantViolation(
                f"K/V tokens counted {self.used_kv_tokens}, "
                f"blocks in use hold {self.blocks.num_used_blocks * self.block_size}"
            )
        for r in owners:
            if (
                not self.blocks.blocks_for(r.num_computed_tokens)
                <= len(r.block_table)
                <= self.blocks.blocks_for(self.max_seq_len)
            ):
                raise InvariantViolation(
                    f"{r.request_id} computed {r.num_computed_tokens} tokens in {len(r.block_table)} blocks"
                )
            for i, block_id in enumerate(r.block_table):
                h = self.blocks.blocks[block_id].hash
                if h is not None and (i >= len(r.block_hashes) or r.block_hashes[i] != h):
                    raise InvariantViolation(f"{r.request_id}'s block {i} is cached for another prefix")
