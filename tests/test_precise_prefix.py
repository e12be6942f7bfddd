"""Routing on the replicas' real cache contents: a paged replica's K/V events (blocks stored and
evicted, numbered batches on its load reports, snapshots when a batch was lost, the bound was
passed or the replica restarted), the router's bounded block index kept from them, and the
`precise_prefix` policy scoring by it, on the real block manager, router and simulator."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from metrics.definitions import SLO, RequestTrace
from metrics.goodput_report import analyze, format_report, index_staleness, slo_by_cache
from metrics.store import open_store
from protocol.blocks import block_hashes
from protocol.clock import FakeClock
from protocol.messages import KvEvents, LoadReport
from protocol.routing import RouteRequest
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model.fake import FlatCostModel, ScriptedFakeRunner
from replica.scheduling.block_manager import BlockManager
from replica.scheduling.kv_events import KvEventBuffer, with_kv_events
from replica.scheduling.request import Request, SamplingParams
from replica.serving.loop import AsyncEngine
from router.block_index import BlockIndex
from router.router import Router
from sim.cost_model import FittedCostModel
from sim.simulator import SimulationConfig, Simulator, measure_capacity, record_simulation
from workloads.prefixes import best_prefix_hit_rate
from workloads.standard import standard_spec

BS = 4


def computed(manager: BlockManager, tokens: list[int], rid: str) -> Request:
    """A request whose `tokens` are allocated and computed, its full blocks cached."""
    r = Request(rid, list(tokens), SamplingParams(), 0.0)
    manager.allocate(r, len(tokens))
    r.num_computed_tokens = len(tokens)
    manager.cache_computed(r)
    return r


def report(replica_id: str, t: float, events: KvEvents | None, pending: int = 0) -> LoadReport:
    return LoadReport(replica_id, 0, 0, 8, 8, 4096, t, prefill_tokens_pending=pending, kv_events=events)


def test_store_and_evict_are_batched_in_numbered_order():
    """The first batch is a snapshot (a new replica holds nothing the router may believe); a
    computed request's full blocks come next as stored, by the chained hashes of
    protocol.blocks; blocks evicted to make room come as removed; nothing changed: no batch."""
    m = BlockManager(num_blocks=4, block_size=BS, prefix_caching=True)
    assert m.kv_events.take() == KvEvents(0, stored=[], removed=[], reset=True)
    tokens = list(range(9))
    a = computed(m, tokens, "a")
    first = m.kv_events.take()
    assert first == KvEvents(1, stored=block_hashes(tokens, BS), removed=[])
    assert m.kv_events.take() is None
    m.free(a)  # two cached blocks and one plain one free: the cache keeps them
    b = computed(m, list(range(50, 62)), "b")  # the two plain blocks, then evicts a's tail
    assert m.kv_events.take() == KvEvents(2, stored=block_hashes(b.prompt_token_ids, BS), removed=[first.stored[1]])
    assert BlockManager(4, BS).kv_events is None  # no prefix cache, no events


def test_netted_changes_and_the_bound():
    """A block stored and evicted within one batch is only in removed (the router may have held
    it from before); past max_events changes the next batch is a snapshot of the whole cache."""
    cache = {1: None, 2: None}
    buffer = KvEventBuffer(lambda: list(cache), max_events=3)
    buffer.take()
    buffer.stored(7)
    buffer.removed(7)
    buffer.removed(2)
    buffer.stored(2)
    assert buffer.take() == KvEvents(1, stored=[2], removed=[7])
    for h in range(10, 14):
        buffer.stored(h)
    assert buffer.take() == KvEvents(2, stored=[1, 2], removed=[], reset=True)
    assert buffer.snapshots == 2
    with pytest.raises(ValueError, match="max_events"):
        KvEventBuffer(list, max_events=0)


def test_a_snapshot_goes_unasked_every_so_many_batches():
    """Batch 0 and every snapshot_every-th after it is a snapshot even with nothing asked, so a
    router whose request for one cannot reach the replica is back in step within that many."""
    buffer = KvEventBuffer(lambda: [5], snapshot_every=3)
    resets = []
    for h in range(7):
        buffer.stored(h)
        resets.append(buffer.take().reset)
    assert resets == [True, False, False, True, False, False, True]


def test_a_lost_batch_is_a_gap_answered_with_a_snapshot():
    """A batch that overtakes an earlier one is held and applied in order; when the missing
    one never comes the router drops what it held of the replica, asks once for a snapshot,
    and the snapshot puts its index back equal to the replica's cache."""
    m = BlockManager(num_blocks=64, block_size=BS, prefix_caching=True)
    router = Router(["r0", "r1"], "precise_prefix", FakeClock(), seed=0)
    index = router.block_index
    index.max_held = 2
    router.report(report("r0", 0.0, m.kv_events.take()))
    computed(m, list(range(8)), "a")
    early, late = m.kv_events.take(), None
    computed(m, list(range(100, 108)), "b")
    late = m.kv_events.take()
    router.report(report("r0", 0.2, late))  # overtook `early`: held
    assert index.num_blocks("r0") == 0
    router.report(report("r0", 0.1, early))
    assert index.num_blocks("r0") == 4 and index.gaps == 0
    for tokens in ([200, 201, 202, 203], [300, 301, 302, 303], [400, 401, 402, 403], [500, 501, 502, 503]):
        computed(m, tokens, tokens[0])
        batch = m.kv_events.take()
        if tokens[0] != 200:  # the batch of 200 is lost on the way
            router.report(report("r0", 1.0, batch))
    assert index.gaps == 1 and index.num_blocks("r0") == 0
    assert index.take_snapshot_requests() == ["r0"] and index.take_snapshot_requests() == []
    m.kv_events.request_snapshot()
    router.report(report("r0", 2.0, m.kv_events.take()))
    assert index.snapshots_wanted == set()
    assert all(index.holds("r0", h) for h in m.cached_hashes()) and index.num_blocks("r0") == len(m.cached_hashes())


def test_the_index_is_bounded_per_replica():
    """Past capacity_blocks a replica's least recently used hashes go, holders included; a
    block two replicas hold is matched on both until one evicts it."""
    index = BlockIndex(capacity_blocks=8)
    index.apply("r0", KvEvents(0, stored=list(range(20)), reset=True))
    index.apply("r1", KvEvents(0, stored=[19], reset=True))
    assert index.num_blocks("r0") == 8 and not index.holds("r0", 11) and index.holds("r0", 12)
    assert index.matched_blocks([19], ["r0", "r1"]) == {"r0": 1, "r1": 1}
    index.apply("r0", KvEvents(1, removed=[19]))
    assert index.matched_blocks([19], ["r0", "r1"]) == {"r0": 0, "r1": 1}
    assert 11 not in index._holders and len(index._holders) == 8


def test_a_restarted_replica_starts_from_an_empty_index():
    """A replica the router had indexed restarts: its fresh block manager's first batch is an
    empty snapshot, which empties the router's entries for it; the other replica's stay."""
    router = Router(["r0", "r1"], "precise_prefix", FakeClock())
    for rid in ("r0", "r1"):
        m = BlockManager(num_blocks=16, block_size=BS, prefix_caching=True)
        computed(m, list(range(12)), "a")
        router.report(report(rid, 0.0, m.kv_events.take()))
    assert router.block_index.num_blocks("r0") == 3
    restarted = BlockManager(num_blocks=16, block_size=BS, prefix_caching=True)
    router.report(report("r0", 1.0, restarted.kv_events.take()))
    assert router.block_index.num_blocks("r0") == 0 and router.block_index.num_blocks("r1") == 3
    router.remove_replica("r1")
    assert router.block_index.num_blocks("r1") == 0


def indexed_router(holdings: dict[str, int], pending: dict[str, int] | None = None, seed: int = 0):
    """A precise_prefix router whose replicas' caches hold the first `holdings[r]` blocks of one
    64-token prompt; returns it and the prompt's route request."""
    tokens = list(range(64))
    hashes = block_hashes(tokens, 16)
    router = Router(list(holdings), "precise_prefix", FakeClock(), seed=seed)
    for rid, held in holdings.items():
        events = KvEvents(0, stored=hashes[:held], reset=True)
        router.report(report(rid, 0.0, events, (pending or {}).get(rid, 0)))
    return router, RouteRequest("q", 64, 8, block_hashes=tuple(hashes), block_size=16)


def test_precise_prefix_takes_the_longest_cached_prefix():
    """Equal load: the replica holding three of the prompt's blocks beats the one holding one;
    the score is prompt tokens outside the cached prefix (the last block is always computed),
    each priced at twice a token of pending work."""
    router, request = indexed_router({"r0": 1, "r1": 3, "r2": 0})
    decision = router.route(request)
    assert decision.replica_id == "r1"
    assert decision.scores["r1"] < decision.scores["r0"] < decision.scores["r2"]
    assert decision.scores["r2"] - decision.scores["r1"] == 2 * 48


def test_imbalance_guard_spills_a_hot_prefix():
    """The replica holding the prefix is skipped (+inf) once its pending work passes 1.5 x the
    least plus 4,096 tokens; below it, it wins while its pending work costs less than the 48
    prompt tokens its cache saves (at twice a token of pending work), and loses once it costs more."""
    router, request = indexed_router({"r0": 0, "r1": 3}, pending={"r1": 5000})
    decision = router.route(request)
    assert decision.replica_id == "r0" and decision.scores["r1"] == float("inf")
    for pending, winner in ((90, "r1"), (100, "r0")):
        router, request = indexed_router({"r0": 0, "r1": 3}, pending={"r1": pending})
        assert router.route(request).replica_id == winner


def test_a_request_in_flight_counts_as_cached_before_any_event():
    """The second request on a new 1,024-token prefix follows the first, whose prefill its
    replica has reported done but whose blocks no K/V event has named yet; once the first has
    completed (its blocks no longer pinned) and no event named them, nothing is matched."""
    tokens = list(range(1024))
    hashes = tuple(block_hashes(tokens, 16))
    router = Router(["r0", "r1", "r2", "r3"], "precise_prefix", FakeClock(), seed=3)
    first = router.route(RouteRequest("a", 1025, 8, block_hashes=hashes, block_size=16)).replica_id
    router.report(LoadReport(first, 0, 1, 7, 8, 4096, 1.0, tokens_made={"a": 1}))
    second = router.route(RouteRequest("b", 1025, 8, block_hashes=hashes, block_size=16))
    assert second.replica_id == first and router.block_index.num_blocks(first) == 0
    assert all(s == 2050.0 for r, s in second.scores.items() if r != first) and second.scores[first] < 2050.0
    router.complete("a", first, 8)
    router.complete("b", first, 8)
    third = router.route(RouteRequest("c", 1025, 8, block_hashes=hashes, block_size=16))
    assert len(set(third.scores.values())) == 1


def misses(seed: int, n: int = 40) -> list[str]:
    """Where `n` prompts no replica holds go on four idle replicas (each completed at once)."""
    router = Router(["r0", "r1", "r2", "r3"], "precise_prefix", FakeClock(), seed=seed)
    chosen = []
    for i in range(n):
        hashes = tuple(block_hashes([i] * 64, 16))
        chosen.append(router.route(RouteRequest(f"q{i}", 64, 8, block_hashes=hashes, block_size=16)).replica_id)
        router.complete(f"q{i}", 8)
    return chosen


def test_misses_are_spread_at_random_among_the_least_loaded():
    """Ties on a miss go to a seeded random replica: every replica gets some, the order is not
    a rotation, and the same seed repeats it while another seed does not."""
    chosen = misses(0)
    assert len(Counter(chosen)) == 4 and min(Counter(chosen).values()) >= 4
    assert chosen != [f"r{i % 4}" for i in range(40)]
    assert misses(0) == chosen and misses(1) != chosen


def test_new_prefixes_partition_over_the_replicas_instead_of_piling():
    """Eight new 256-token prefixes in turn on four idle replicas whose K/V events then report
    each computed prefix: every new prefix goes to a replica whose cache holds the fewest
    blocks, so each replica ends up with two prefixes and no prefix is computed twice; a second
    request of each prefix follows it to its replica."""
    replicas = ["r0", "r1", "r2", "r3"]
    router = Router(replicas, "precise_prefix", FakeClock(), seed=5)
    seq = dict.fromkeys(replicas, 0)
    for rid in replicas:
        router.report(report(rid, 0.0, KvEvents(0, stored=[], reset=True)))
    owner = {}
    for k in range(8):
        hashes = block_hashes([k] * 256 + [999], 16)
        chosen = router.route(RouteRequest(f"p{k}", 257, 8, block_hashes=tuple(hashes), block_size=16)).replica_id
        seq[chosen] += 1
        router.report(report(chosen, 0.1 * (k + 1), KvEvents(seq[chosen], stored=hashes[:16])))
        router.complete(f"p{k}", chosen, 8)
        owner[k] = chosen
    assert Counter(owner.values()) == dict.fromkeys(replicas, 2)
    assert all(router.block_index.num_blocks(r) == 32 for r in replicas)
    for k in range(8):
        hashes = block_hashes([k] * 256 + [555], 16)
        again = router.route(RouteRequest(f"q{k}", 257, 8, block_hashes=tuple(hashes), block_size=16))
        assert again.replica_id == owner[k]
        router.complete(f"q{k}", again.replica_id, 8)


def test_a_hit_stays_on_its_replica_while_it_prefills_another_miss():
    """Moderate load: the replica holding a 1,024-token prefix has another request's 1,100 prompt
    tokens still to prefill while three replicas are idle. Waiting for them costs less than
    computing the prefix again elsewhere (and evicting another replica's prefixes for it), so the
    hit stays; only past the imbalance guard does it spill."""
    prompt = list(range(1040))
    hashes = block_hashes(prompt, 16)
    for pending, stays in ((1100, True), (6000, False)):
        router = Router(["r0", "r1", "r2", "r3"], "precise_prefix", FakeClock(), seed=0)
        router.report(report("r0", 0.0, KvEvents(0, stored=hashes[:64], reset=True), pending))
        for rid in ("r1", "r2", "r3"):
            router.report(report(rid, 0.0, KvEvents(0, stored=[], reset=True)))
        decision = router.route(RouteRequest("q", 1040, 8, block_hashes=tuple(hashes), block_size=16))
        assert (decision.replica_id == "r0") == stays
        assert decision.believed_cached == (1024 if stays else 0)


COST = FittedCostModel(c0=0.02, c_decode=0.004, c_prefill=0.001, c_ctx=0.0, c_held=0.0)
ENGINE = EngineConfig(
    policy="chunked", num_slots=8, max_seq_len=1536, kv_cache="paged", prefix_caching=True, kv_budget_tokens=5632
)


def test_precise_beats_approximate_on_kv_pressure_in_the_simulator():
    """kv-pressure on four replicas each holding about a third of the prefixes: the simulator's
    replicas send their K/V events on their load reports (no batch lost), and precise_prefix's
    prefix hit rate beats prefix_affinity's, itself above least_loaded's."""
    config = SimulationConfig(num_replicas=4, engine=ENGINE, seed=1)
    spec = standard_spec("kv-pressure", num_requests=200, seed=1)
    workload = spec.at_load(0.8, measure_capacity(config, COST)).build()
    rates = {}
    for policy in ("least_loaded", "prefix_affinity", "precise_prefix"):
        sim = Simulator(workload, config.model_copy(update={"routing_policy": policy}), COST)
        result = sim.run()
        prefill = sum(s.num_prefill_tokens for steps in result.steps.values() for s in steps)
        rates[policy] = 1 - prefill / sum(r.prompt_len for r in workload.requests)
        index = sim.router.block_index
        assert index.gaps == 0 and index.ignored == 0 and all(index.num_blocks(f"r{i}") > 0 for i in range(4))
    assert rates["precise_prefix"] > rates["prefix_affinity"] > rates["least_loaded"]
    assert rates["precise_prefix"] <= best_prefix_hit_rate(workload, 1, config.vocab_size, 16)


def test_index_staleness_counts_what_was_believed_and_not_found():
    """Three requests a router believed had 64, 32 and 0 cached tokens on their replicas, which
    found 48, 48 and 16 at admission (a moved request's last decision counts; a request without
    an admission count is left out): of the 96 tokens believed, 80 were there."""
    traces = [
        RequestTrace("a", 0.0, [1.0], 1.0, "length", 80, "r0", cached_tokens=48),
        RequestTrace("b", 0.0, [1.0], 1.0, "length", 80, "r1", cached_tokens=48),
        RequestTrace("c", 0.0, [1.0], 1.0, "length", 80, "r2", cached_tokens=16),
        RequestTrace("d", 0.0, [], 1.0, "rejected", 80, None),
    ]
    decisions = [
        {"request_id": "a", "believed_cached": 16},
        {"request_id": "a", "believed_cached": 64},  # moved: this one counts
        {"request_id": "b", "believed_cached": 32},
        {"request_id": "c", "believed_cached": 0},
        {"request_id": "d", "believed_cached": 64},
    ]
    assert index_staleness(traces, decisions) == {"staleness": 1 - 80 / 96, "requests": 2, "believed": 96, "found": 80}
    assert index_staleness(traces[2:], decisions)["staleness"] is None


def test_slo_attainment_is_split_by_whether_the_prompt_found_a_cached_prefix():
    """Two requests found a cached prefix (one met the SLO), two computed their whole prompt
    (neither met it: one too slow to its first token, one failed); a request that reported no
    admission count and one rejected before a replica are in neither group."""
    slo = SLO(ttft=0.5, tpot=1.0)
    traces = [
        RequestTrace("a", 0.0, [0.1], 0.1, "length", 80, "r0", cached_tokens=64),
        RequestTrace("b", 0.0, [0.9], 0.9, "length", 80, "r1", cached_tokens=16),
        RequestTrace("c", 0.0, [0.7], 0.7, "length", 80, "r1", cached_tokens=0),
        RequestTrace("d", 0.0, [], 0.2, "error", 80, "r0", cached_tokens=0),
        RequestTrace("e", 0.0, [0.1], 0.1, "length", 80, "r0"),
        RequestTrace("f", 0.0, [], 0.0, "rejected", 80, None),
    ]
    assert slo_by_cache(traces, slo) == {
        "cached": {"requests": 2, "slo_met": 0.5},
        "computed": {"requests": 2, "slo_met": 0.0},
    }
    assert slo_by_cache(traces[4:], slo)["cached"] == {"requests": 0, "slo_met": None}


def test_a_simulated_run_stores_belief_and_admission_counts(tmp_path):
    """The simulator's router logs what precise_prefix believed cached on each chosen replica and
    the replica's first admission what its cache held; both reach the store, and the report reads
    the staleness from them (the precise index is right about nearly every block it names)."""
    config = SimulationConfig(num_replicas=4, engine=ENGINE, routing_policy="precise_prefix", seed=0)
    workload = (
        standard_spec("kv-pressure", num_requests=60, seed=0).at_load(0.8, measure_capacity(config, COST)).build()
    )
    result = Simulator(workload, config, COST).run()
    store = open_store(tmp_path / "s.db")
    run_id = record_simulation(store, result, "kv")
    rows = store.requests(run_id)
    assert all(r["cached_tokens"] is not None for r in rows) and any(r["cached_tokens"] >= 1024 for r in rows)
    assert any(d["believed_cached"] for d in store.decisions(run_id))
    analysis = analyze(store, run_id, SLO(ttft=0.5, tpot=0.05))
    staleness = analysis["index_staleness"]
    assert staleness["requests"] > 30 and staleness["staleness"] < 0.05
    by_cache = analysis["slo_by_cache"]
    assert by_cache["cached"]["requests"] + by_cache["computed"]["requests"] == len(rows)
    assert by_cache["cached"]["slo_met"] > by_cache["computed"]["slo_met"]  # a 1,024-token miss is slow
    assert "requests that found a cached prefix" in format_report([analysis])


def test_a_snapshot_asked_of_the_serving_loop_goes_on_its_next_report():
    """The router's ask for a snapshot reaches the prefix cache between steps (the step thread
    records the cache's changes): the serving loop wakes, sets it on the paged slot table, and
    its next load report carries the whole cache as a reset batch. A table that caches no
    prefixes has no events to snapshot."""
    clock = FakeClock()
    config = EngineConfig(num_slots=2, max_seq_len=64, kv_cache="paged", block_size=BS, prefix_caching=True)
    engine = Engine(config, ScriptedFakeRunner(clock, FlatCostModel(0.001)), clock)
    slots = engine.scheduler.slots
    batches: list[KvEvents | None] = []
    serving = AsyncEngine(engine, on_load=lambda load: batches.append(with_kv_events(load, slots).kv_events))

    async def main() -> None:
        async for _ in serving.generate(list(range(1, 14)), {"max_tokens": 3, "ignore_eos": True}, "a"):
            pass
        for _ in range(10):
            await asyncio.sleep(0)
        sent = len(batches)
        serving.request_kv_snapshot()
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(batches) > sent, "the ask woke the idle loop, which reported"

    asyncio.run(asyncio.wait_for(main(), 30))
    assert batches[0].reset and any(b is not None and not b.reset and b.stored for b in batches)
    snapshot = batches[-1]
    cached = list(slots.blocks.cached_hashes())
    assert snapshot.reset and snapshot.stored == cached and len(cached) == 3  # 13 prompt tokens: 3 full blocks
    assert snapshot.seq == max(b.seq for b in batches if b is not None)
    assert (
        Engine(
            EngineConfig(num_slots=2, max_seq_len=64), ScriptedFakeRunner(clock), clock
        ).scheduler.slots.request_kv_snapshot()
        is False
    )
