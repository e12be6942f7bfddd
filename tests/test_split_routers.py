"""Routing split across several routers in the simulator (`SimulationConfig.routers`), as Ray
Serve's ingresses each route on their own: request i is routed by router i mod N, which alone
hears of its end, while every router is told every replica's load reports and K/V events."""

from __future__ import annotations

from collections import Counter, deque

import pytest

from autoscaling.policies import AutoscaleConfig
from protocol.messages import KvEvents
from replica.config import EngineConfig
from replica.errors import ConfigError
from replica.model.fake import FlatCostModel
from router.block_index import BlockIndex
from sim.autoscaling import AutoscalingSimulator
from sim.cost_model import FittedCostModel
from sim.disaggregation import PdSimulator, SimPools
from sim.simulator import SimulationConfig, Simulator, measure_capacity
from workloads.standard import bursty_mix, standard_spec

COST = FittedCostModel(c0=0.02, c_decode=0.004, c_prefill=0.001, c_ctx=0.0, c_held=0.0)
ENGINE = EngineConfig(
    policy="chunked", num_slots=8, max_seq_len=1536, kv_cache="paged", prefix_caching=True, kv_budget_tokens=5632
)


def test_each_router_routes_its_share_hears_its_own_ends_and_every_replicas_reports():
    """kv-pressure on four replicas behind two precise_prefix routers: each routed half the
    requests, every request is served and its decision kept (in time order), each router heard
    the end of every request it routed and of no other (nothing left in flight, no unknown
    completion), and both were given the same load reports, K/V events included, from every
    replica, so their block indexes agree."""
    config = SimulationConfig(num_replicas=4, engine=ENGINE, routing_policy="precise_prefix", seed=1)
    workload = (
        standard_spec("kv-pressure", num_requests=80, seed=1).at_load(0.8, measure_capacity(config, COST)).build()
    )
    sim = Simulator(workload, config.model_copy(update={"routers": 2}), COST)
    received = [Counter() for _ in sim.routers]
    for router, counts in zip(sim.routers, received):
        report = router.report

        def counted(load, report=report, counts=counts):
            counts[load.replica_id, load.kv_events is not None] += 1
            return report(load)

        router.report = counted
    result = sim.run()

    assert [router.routed for router in sim.routers] == [40, 40]
    assert all(t.finish_reason == "length" and t.replica is not None for t in result.traces)
    assert sorted(d.request_id for d in result.decisions) == sorted(t.request_id for t in result.traces)
    assert [d.time for d in result.decisions] == sorted(d.time for d in result.decisions)
    now = sim.clock.now()
    for router in sim.routers:
        assert router.load.unknown_completions == 0
        assert all(v.in_flight == 0 for v in router.load.views(now))
    assert received[0] == received[1]
    assert all(received[0][f"r{i}", True] > 1 for i in range(4))  # K/V event batches from every replica
    first, second = (router.load.views(now) for router in sim.routers)
    assert all(a.report is not None and a.report is b.report for a, b in zip(first, second))
    indexes = [router.block_index for router in sim.routers]
    assert all(index.gaps == 0 and index.ignored == 0 for index in indexes)
    blocks = [[index.num_blocks(f"r{i}") for i in range(4)] for index in indexes]
    assert blocks[0] == blocks[1] and all(n > 0 for n in blocks[0])


def test_request_i_goes_to_router_i_mod_n_each_with_its_own_state():
    """Two round_robin routers over four replicas: even requests go to router 0, odd ones to
    router 1, and each cycles the replicas on its own, so consecutive pairs share a replica."""
    workload = bursty_mix(40, rate=30.0, burst_factor=4.0, period=1.0, seed=1)
    config = SimulationConfig(
        num_replicas=4, routing_policy="round_robin", routers=2, engine=EngineConfig(policy="continuous", num_slots=4)
    )
    result = Simulator(workload, config, FlatCostModel(0.05)).run()
    assert [d.request_id for d in result.decisions] == [t.request_id for t in result.traces]
    assert [d.replica_id for d in result.decisions] == [f"r{(i // 2) % 4}" for i in range(40)]


def test_simulators_of_one_router_refuse_several():
    """The autoscaled and the two-pool simulators change or route again through one router."""
    config = SimulationConfig(num_replicas=2, routers=2, engine=EngineConfig(policy="continuous", num_slots=4))
    workload = bursty_mix(4, rate=10.0, burst_factor=1.0, period=1.0, seed=0)
    with pytest.raises(ConfigError, match="one router"):
        PdSimulator(workload, config, SimPools(prefill_replicas=1))
    with pytest.raises(ConfigError, match="one router"):
        AutoscalingSimulator(workload, config, AutoscaleConfig(policy="target_ongoing", min_replicas=1))


def test_a_client_routing_locally_catches_up_on_kv_events_from_the_log_or_from_a_snapshot():
    """`BlockIndex.catch_up` (the router actor's answer to a local router's sync) leaves the client's
    block index holding what the actor's holds: from the batches it missed while they are in
    the log, from the actor's snapshot once they fell out of it or when it has none yet."""
    actor, log = BlockIndex(), deque(maxlen=4)

    def send(events: KvEvents) -> None:
        actor.apply("r0", events)
        log.append(events)

    def synced(client: BlockIndex) -> None:
        for batch in actor.catch_up("r0", log, client.next_seq("r0")):
            client.apply("r0", batch)
        assert client.next_seq("r0") == actor.next_seq("r0")
        assert {h for h in range(100) if client.holds("r0", h)} == {h for h in range(100) if actor.holds("r0", h)}

    send(KvEvents(0, [1, 2, 3], reset=True))
    client = BlockIndex()
    synced(client)  # none yet: the snapshot
    send(KvEvents(1, [4], [1]))
    send(KvEvents(2, [5]))
    assert [b.seq for b in actor.catch_up("r0", log, client.next_seq("r0"))] == [1, 2]
    synced(client)  # from the log
    assert actor.catch_up("r0", log, client.next_seq("r0")) == []  # up to date: nothing sent
    for seq in range(3, 9):  # more than the log holds
        send(KvEvents(seq, [10 + seq], [seq + 1]))
    assert actor.catch_up("r0", log, client.next_seq("r0"))[0].reset
    synced(client)  # from the actor's snapshot
