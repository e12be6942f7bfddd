"""Routing on the Ray cluster with what the work- and cache-aware policies need: the client
sends the prompt's block hashes, completions carry output lengths, and the pure Router can run
inside the client (`Client(routing="local")`) fed by the router actor's reports. Local Ray,
fake-step replicas."""

from __future__ import annotations

import pytest
import ray

from cluster.client import Client
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from metrics.store import MetricsStore
from protocol.clock import FakeClock
from replica import Engine, EngineConfig, InvalidRequestError
from replica.model.fake import FlatCostModel, ScriptedFakeRunner
from replica.serving.loop import ReplicaConfig
from tests.test_cluster import replay_bursty
from tests.waiting import wait_until
from workloads import bursty_mix

PAGED = EngineConfig(num_slots=4, max_seq_len=256, kv_cache="paged", prefix_caching=True, block_size=16)
FAKE = ReplicaConfig(engine=PAGED, fake_step_seconds=0.005)


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """One local Ray instance and one 2-replica fake cluster (with a store) for the module:
    each test sets the router's policy it needs; a cluster start is the slow part here."""
    path = tmp_path_factory.mktemp("routing-cluster")
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    deployment = start_cluster(ClusterSpec(num_replicas=2, replica=FAKE, store_path=str(path / "store.db")))
    yield path, deployment
    stop_cluster()
    ray.shutdown()


def test_final_output_carries_the_output_length():
    """The engine's final output says how many tokens the request made, which the replica
    passes to the router's `complete` so length estimates learn."""
    clock = FakeClock()
    engine = Engine(EngineConfig(num_slots=2, max_seq_len=64), ScriptedFakeRunner(clock, FlatCostModel(0.01)), clock)
    engine.add_request([5, 6, 7], {"max_tokens": 7, "ignore_eos": True}, request_id="a")
    finals = []
    while engine.has_unfinished:
        finals += [o for o in engine.step().outputs if o.finished]
    assert [(o.request_id, o.num_output_tokens) for o in finals] == [("a", 7)]


def test_prefix_affinity_follows_the_prompt_blocks(local_ray):
    """With idle replicas the only difference prefix_affinity sees is where a prompt's blocks
    are cached, which it knows only from the block hashes the client sends: every request
    sharing a 64-token prefix goes to the replica the first went to (without hashes the tied
    scores would alternate), through the router actor and routing in the client alike."""
    _, deployment = local_ray
    ray.get(deployment.router.set_policy.remote("prefix_affinity"))
    for routing, first in (("actor", 200), ("local", 400)):
        prefix = list(range(first, first + 64))
        with Client(routing=routing) as client:
            assert client.block_size == 16
            replicas = [client.generate(prefix + [300 + i] * 8, max_tokens=2).replica_id for i in range(4)]
        assert len(set(replicas)) == 1, (routing, replicas)


def test_routing_in_the_client_serves_records_and_learns(local_ray):
    """A workload replayed with the router inside the driver's client: every request ends,
    both replicas serve, every decision is recorded under the run (shipped to the router
    actor by the sync thread), nothing stays counted in flight, and the length estimate
    learned from the finished requests' output lengths."""
    path, deployment = local_ray
    ray.get(deployment.router.set_policy.remote("predicted_length"))
    store, run_id = replay_bursty(deployment, path / "store.db", 2, "predicted_length", client_routing="local")
    assert {d["policy"] for d in store.decisions(run_id)} == {"predicted_length"}

    with pytest.raises(InvalidRequestError, match="routing"):
        Client(routing="nearby")
    with Client(routing="local") as client:
        local = client.local_router
        assert local.policy == "predicted_length" and local.syncs >= 1
        client.generate([7] * 20, max_tokens=5, ignore_eos=True, session_id="s")
        router = local._router
        assert sum(v.in_flight for v in router.load.views(0.0)) == 0
        # the session's last output (5 tokens) is what predicted_length now expects of it
        probe = router.policy.lengths.estimate(_route("x", 20, "s"))
        assert probe == 5


@pytest.mark.timeout(300)
def test_ray_serve_peer_serves_the_same_engine_and_records(local_ray):
    """The replica engine as a Ray Serve deployment: with Serve's default router a workload
    replayed through it is recorded in the store with every token (both replicas serving) and
    every replica's step records (which ride on the token stream); static batches of 2 on 13
    requests leave one replica a last request alone, which starts only because the replicas
    hear that no more requests are coming. With Serve's PrefixCacheAffinityRouter, prompts of
    token ids sharing a 64-token prefix all go to one replica, which it can only know from the
    token-per-character prompt text."""
    from cluster.serve_baseline import ServeBaseline, ServeRequest, token_text
    from cluster.store_actor import StoreActor

    path = local_ray[0] / "serve.db"
    store_actor = StoreActor.remote(str(path))
    static = ReplicaConfig(engine=EngineConfig(policy="static", num_slots=2, max_seq_len=256), fake_step_seconds=0.005)
    baseline = None
    try:
        baseline = ServeBaseline(static, 2, "serve_power_of_two", store_actor, num_cpus=0.5)
        workload = bursty_mix(num_requests=13, rate=40.0, seed=3)
        run_id = baseline.run_workload(workload, name="serve", config={}, batching_policy="static", vocab_size=1000)
        store = MetricsStore(path)
        traces = store.traces(run_id)
        assert len(traces) == 13 and all(t.finish_reason == "length" for t in traces)
        assert sorted(t.num_output_tokens for t in traces) == sorted(workload.output_lens)
        assert len({t.replica for t in traces}) == 2 and store.run(run_id)["routing_policy"] == "serve_power_of_two"
        steps = store.steps(run_id)
        assert {s["replica_id"] for s in steps} == {t.replica for t in traces}
        assert sum(s["num_prefill_tokens"] for s in steps) == sum(r.prompt_len for r in workload.requests)
        baseline.shutdown()

        continuous = static.model_copy(update={"engine": static.engine.model_copy(update={"policy": "continuous"})})
        baseline = ServeBaseline(continuous, 2, "serve_prefix_cache", store_actor, num_cpus=0.5)
        prefix = list(range(200, 264))
        replicas = set()
        for i in range(4):
            ids = prefix + [300 + i] * 4
            request = ServeRequest(f"p{i}", ids, 2, 0.0, token_text(ids))
            replicas |= {chunk.replica_id for chunk in baseline.handle.options(stream=True).remote(request)}
        assert len(replicas) == 1, replicas
    finally:
        if baseline is not None:
            baseline.shutdown()
        ray.kill(store_actor)


def _route(request_id: str, prompt_len: int, session: str):
    from protocol.routing import RouteRequest

    return RouteRequest(request_id, prompt_len, 64, session)


def test_a_gap_in_kv_events_brings_a_snapshot_from_the_replica(local_ray):
    """On Ray: when a replica's K/V event batches show a gap (here batches numbered far ahead,
    as if the ones between were lost), the router drops what it held of that replica and asks
    the replica actor for a snapshot, whose next load report carries its whole prefix cache:
    the router's index of it is back, and nothing is wanted any more."""
    from protocol.messages import KvEvents, LoadReport

    _, deployment = local_ray
    ray.get(deployment.router.set_policy.remote("precise_prefix"))
    with Client() as client:
        served = client.generate(list(range(500, 564)) + [7] * 8, max_tokens=2).replica_id

    def index() -> dict:
        return ray.get(deployment.router.status.remote())["kv_index"]

    wait_until(lambda: index()["blocks"][served] >= 4, 20, "the 4 full blocks of its 64 prompt tokens in the index")
    gaps = index()["gaps"]
    for seq in range(10**6, 10**6 + 9):  # more than the router holds ahead of a missing batch
        events = KvEvents(seq, stored=[seq], removed=[])
        ray.get(deployment.router.report.remote(LoadReport(served, 0, 0, 4, 4, 1024, 0.0, kv_events=events)))
    assert index()["gaps"] == gaps + 1
    wait_until(
        lambda: index()["snapshots_wanted"] == [] and index()["blocks"][served] >= 4, 20, "the snapshot to be indexed"
    )


@pytest.mark.timeout(300)
def test_a_precise_prefix_run_stores_what_each_replica_found_cached(local_ray, capsys):
    """On Ray, the prompt tokens a replica's prefix cache held when it first admitted a request
    ride on the request's last event to the client's trace and into the store: in a
    precise_prefix run of 16 prompts on two 64-token prefixes every request has its count, the
    repeats of a prefix found all of it, and `slotserve report` prints the index staleness it
    measures against what the router believed cached."""
    from cli.main import main
    from cluster.driver import run_workload
    from workloads.workload import Workload, WorkloadRequest

    path, deployment = local_ray
    ray.get(deployment.router.set_policy.remote("precise_prefix"))
    requests = [
        WorkloadRequest(0.05 * i, 80, 4, blocks=tuple(range(4 * (i % 2), 4 * (i % 2) + 4)), block_len=16)
        for i in range(16)
    ]
    run_id = run_workload(
        deployment,
        Workload("two-prefixes", 7, requests),
        name="two-prefixes",
        config={},
        batching_policy="continuous",
        routing_policy="precise_prefix",
        progress=False,
    )
    store = MetricsStore(path / "store.db")
    rows = store.requests(run_id)
    assert len(rows) == 16 and all(r["finish_reason"] == "length" for r in rows)
    assert all(r["cached_tokens"] is not None for r in rows), rows
    assert sum(r["cached_tokens"] == 64 for r in rows) >= 12  # all but the first of each prefix, nearly
    assert any(d["believed_cached"] for d in store.decisions(run_id))
    capsys.readouterr()
    assert main(["report", str(run_id), "--store", str(path / "store.db")]) == 0
    assert "prefix index staleness" in capsys.readouterr().out
