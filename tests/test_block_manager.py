"""The paged cache's block manager alone (no engine): blocks taken as a request grows and
conserved, prefix hits only on whole equal prefixes of computed blocks, the last token always
left to compute, and freed cached blocks reused before they are evicted (plain free blocks
first, then least recently freed, a prefix's tail before its head); the blocks are filed under
`protocol.blocks`' hashes, the ones a client sends and a router indexes; both cache tables answer
the scheduler's one interface."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from protocol.blocks import block_hashes, cacheable_block_hashes
from replica.scheduling.block_manager import BlockManager, PagedSlotTable
from replica.scheduling.request import Request, SamplingParams
from replica.scheduling.scheduler import SchedulerConfig
from replica.scheduling.slot_table import SlotTable, TokenSlotTable

BS = 4


def request(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams(), 0.0)


def computed(manager: BlockManager, tokens: list[int], rid: str) -> Request:
    """A request whose `tokens` are all allocated and computed, its full blocks cached."""
    r = request(tokens, rid)
    manager.allocate(r, len(tokens))
    r.num_computed_tokens = len(tokens)
    manager.cache_computed(r)
    manager.check_invariants([r])
    return r


def test_blocks_are_taken_as_a_request_grows_and_all_come_back():
    """5 tokens take 2 blocks of 4, 9 take 3; growing again to the same size takes nothing; a
    growth the free blocks cannot cover takes nothing and says so; freeing returns them all."""
    m = BlockManager(num_blocks=4, block_size=BS)
    r = request(range(5))
    m.allocate(r, 5)
    assert len(r.block_table) == 2 and m.num_free_blocks == 2
    assert m.grow(r, 9) and len(r.block_table) == 3
    assert m.grow(r, 9) and len(r.block_table) == 3
    assert not m.grow(r, 17) and len(r.block_table) == 3 and m.num_free_blocks == 1
    m.check_invariants([r])
    m.free(r)
    assert r.block_table == [] and m.num_free_blocks == 4 and m.num_used_blocks == 0
    m.check_invariants([])


def test_hits_need_the_whole_prefix_equal():
    """Hashes chain over blocks: an equal second block after a different first one is no hit."""
    m = BlockManager(num_blocks=16, block_size=BS, prefix_caching=True)
    a = computed(m, [1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    assert m.prefix_hits(request([1, 2, 3, 4, 5, 6, 7, 8, 0])) == a.block_table[:2]
    assert m.prefix_hits(request([1, 2, 3, 4, 0, 6, 7, 8, 9])) == a.block_table[:1]
    assert m.prefix_hits(request([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_cached_blocks_are_filed_under_the_protocol_block_hashes():
    """The hashes the cache files a request's computed blocks under are `protocol.blocks`' for
    its tokens, so a router's index names the same prefix the same way; a hit is looked up
    under `cacheable_block_hashes` of the prompt."""
    m = BlockManager(num_blocks=16, block_size=BS, prefix_caching=True)
    tokens = [5, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    a = computed(m, tokens, "a")
    assert a.block_hashes == block_hashes(tokens, BS)
    assert [m.blocks[b].hash for b in a.block_table[:2]] == block_hashes(tokens, BS)
    prompt = tokens[:8] + [7]
    hits = m.prefix_hits(request(prompt))
    assert [m.blocks[b].hash for b in hits] == cacheable_block_hashes(prompt, BS) and len(hits) == 2


def test_both_tables_answer_the_scheduler_each_reserving_its_own_way():
    """TokenSlotTable reserves by the token, PagedSlotTable by the block (9 tokens: 3 blocks of
    4); both are SlotTables, the interface the scheduler asks, which alone cannot be built."""
    token, paged = TokenSlotTable(2, 16), PagedSlotTable(2, 16, num_blocks=8, block_size=BS)
    for table, reserved in ((token, 9), (paged, 12)):
        assert isinstance(table, SlotTable)
        r = request(range(6))
        assert table.can_admit(r, 6)
        table.admit(r, 6)
        assert table.owner(r.slot) is r and table.num_used_slots == 1
        assert table.reserve(r, 9) and table.used_kv_tokens == reserved
        table.check_invariants()
        table.release(r)
        assert table.num_free_slots == 2 and table.used_kv_tokens == 0
    with pytest.raises(TypeError, match="abstract"):
        SlotTable(2, 16)


def test_hits_leave_the_last_token_to_compute():
    """A prompt equal to a cached 8-token one hits only its first block: the block with the last
    token is computed again, so the request samples its first token from real logits."""
    m = BlockManager(num_blocks=16, block_size=BS, prefix_caching=True)
    a = computed(m, list(range(8)), "a")
    b = request(list(range(8)), "b")
    assert m.prefix_hits(b) == a.block_table[:1]
    m.allocate(b, 8)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert m.blocks[a.block_table[0]].ref_count == 2
    m.check_invariants([a, b])


def test_only_computed_full_blocks_are_shared():
    """Blocks allocated for tokens not yet computed (or only partly filled) are never hits."""
    m = BlockManager(num_blocks=16, block_size=BS, prefix_caching=True)
    a = request(list(range(12)), "a")
    m.allocate(a, 12)
    a.num_computed_tokens = 6  # a chunked prefill part way through its second block
    m.cache_computed(a)
    assert m.prefix_hits(request(list(range(12)) + [99], "b")) == a.block_table[:1]


def test_freed_cached_blocks_are_reused_then_evicted_tail_first():
    """A finished request's cached blocks stay on the free list: a later request with the same
    prefix takes them back (ref 0 -> 1) instead of recomputing. Plain free blocks are handed
    out before cached ones; cached ones go least recently freed first, a prefix's tail first."""
    m = BlockManager(num_blocks=6, block_size=BS, prefix_caching=True)
    a = computed(m, list(range(13)), "a")  # 3 full cached blocks + 1 partly filled
    head, middle, tail, partial = a.block_table
    m.free(a)
    assert m.num_free_blocks == 6 and m.blocks[head].hash is not None and m.blocks[partial].hash is None
    b = request(list(range(12)) + [77], "b")
    assert m.can_allocate(b, 13) and m.prefix_hits(b) == [head, middle, tail]
    m.allocate(b, 13)
    assert b.block_table[:3] == [head, middle, tail] and m.num_free_blocks == 2
    m.check_invariants([b])
    m.free(b)
    c = request(list(range(100, 113)), "c")  # shares nothing: takes 3 plain blocks, then evicts
    m.allocate(c, 13)
    assert c.block_table[:3] == sorted({0, 1, 2, 3, 4, 5} - {head, middle, tail})
    assert c.block_table[3] == tail and m.blocks[tail].hash != a.block_hashes[2]
    assert m.prefix_hits(request(list(range(13)), "d")) == [head, middle]
    m.check_invariants([c])


def test_reset_forgets_free_cached_blocks_and_keeps_those_in_use():
    """reset_prefix_cache() turns every cached block no request holds into a plain free block
    (a later equal prompt hits nothing), while a running request's shared blocks stay cached."""
    m = BlockManager(num_blocks=8, block_size=BS, prefix_caching=True)
    m.free(computed(m, list(range(9)), "a"))  # 2 full cached blocks + 1 partly filled, freed
    b = computed(m, list(range(100, 109)), "b")
    assert len(m.prefix_hits(request(list(range(9)), "x"))) == 2
    assert m.reset_prefix_cache() == 2
    assert m.prefix_hits(request(list(range(9)), "y")) == [] and m.num_free_blocks == 5
    assert len(m.prefix_hits(request(list(range(100, 109)), "z"))) == 2  # b still holds its blocks
    m.check_invariants([b])
    m.free(b)
    assert m.reset_prefix_cache() == 2 and m.num_free_blocks == 8
    m.check_invariants([])


def test_can_allocate_counts_a_revived_block_as_taken():
    """A hit on a free cached block takes it off the free list; a hit on a block in use is free."""
    m = BlockManager(num_blocks=3, block_size=BS, prefix_caching=True)
    a = computed(m, list(range(8)), "a")
    m.free(a)
    b = request(list(range(8)) + [1, 2, 3, 4], "b")  # 2 hits (both revived) + 1 new block = all 3
    assert m.can_allocate(b, 12) and not m.can_allocate(b, 13)
    m.allocate(b, 8)
    c = request(list(range(4)) + [9, 9], "c")  # 1 hit on b's block (in use) + 1 new
    assert m.can_allocate(c, 6)
    m.allocate(c, 6)
    assert m.num_free_blocks == 0 and m.blocks[b.block_table[0]].ref_count == 2
    m.check_invariants([b, c])


def test_config_rejects_prefix_caching_without_paging_and_a_budget_under_one_block():
    with pytest.raises(ValidationError, match="prefix_caching"):
        SchedulerConfig(prefix_caching=True)
    with pytest.raises(ValidationError, match="no whole block"):
        SchedulerConfig(kv_cache="paged", block_size=16, kv_budget_tokens=15)
    assert SchedulerConfig(kv_cache="paged", block_size=16, kv_budget_tokens=4096).num_blocks == 256
