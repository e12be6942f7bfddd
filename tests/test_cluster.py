"""The Ray cluster end to end: replicas behind the router on a real local Ray instance (and
on a three-node `ray.cluster_utils.Cluster`), streaming clients, the driver and the store."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
import ray

from cluster.client import Client, ClusterError, connect
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from cluster.driver import run_workload
from metrics.store import MetricsStore
from replica import Engine, EngineConfig, InvalidRequestError
from replica.serving.loop import ReplicaConfig
from tests.waiting import wait_until
from workloads import bursty_mix

FAKE = ReplicaConfig(engine=EngineConfig(num_slots=4, max_seq_len=256), fake_step_seconds=0.005)


@pytest.fixture(scope="module")
def ray_of_the_module():
    """The module's local Ray instance, started by the first test that needs one (again after
    the multi-node test, which stops it to join a cluster of its own) and stopped at the end:
    each test starts its own slotserve cluster on it and stops it."""
    yield
    ray.shutdown()


@pytest.fixture
def local_ray(ray_of_the_module, tmp_path):
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    yield tmp_path
    stop_cluster()


def replay_bursty(
    deployment, store_path, seed: int, routing_policy: str = "least_loaded", client_routing: str = "actor"
) -> tuple[MetricsStore, int]:
    """24 bursty requests replayed by the driver through a two-replica cluster: every one is
    recorded as ended at its full length, both replicas served, every decision is recorded."""
    workload = bursty_mix(num_requests=24, rate=50.0, seed=seed)
    run_id = run_workload(
        deployment,
        workload,
        name=f"bursty-{client_routing}",
        config={},
        batching_policy="continuous",
        routing_policy=routing_policy,
        progress=False,
        client_routing=client_routing,
    )
    store = MetricsStore(store_path)
    traces = store.traces(run_id)
    assert len(traces) == 24 and all(t.finish_reason == "length" for t in traces)
    assert sorted(t.num_output_tokens for t in traces) == sorted(r.output_len for r in workload.requests)
    assert {t.replica for t in traces} == {"replica-0", "replica-1"}
    assert len(store.decisions(run_id)) == 24
    return store, run_id


def test_fake_cluster_serves_streams_and_records(local_ray):
    """Two fake replicas behind the router: concurrent streamed requests all finish, each
    token arrives as its own event, both replicas serve, and the driver records every
    request, token, step and routing decision in the store."""
    store_path = local_ray / "store.db"
    deployment = start_cluster(ClusterSpec(num_replicas=2, replica=FAKE, store_path=str(store_path)))
    client = Client()
    events = list(client.stream([1, 2, 3], max_tokens=8, ignore_eos=True))
    assert [len(e.token_ids) for e in events] == [1] * 8 and events[-1].finish_reason == "length"
    assert events[0].time < events[-1].made

    store, run_id = replay_bursty(deployment, store_path, seed=1)
    assert sum(s["num_decode_tokens"] + s["num_prefill_tokens"] > 0 for s in store.steps(run_id)) > 10
    assert store.run(run_id)["status"] == "complete"


def test_start_cluster_returns_once_every_replica_is_up_or_names_those_that_are_not(local_ray):
    """start_cluster returns only once the router routes to every replica (each passed its first
    health check), so a request sent at once is served; replicas that pass none within
    `ready_timeout` (here: the router's first check is a minute away) stop the cluster with an
    error naming each and why."""
    spec = ClusterSpec(num_replicas=2, replica=FAKE, store_path=str(local_ray / "s.db"), health_period=0.2)
    deployment = start_cluster(spec)
    assert ray.get(deployment.router.status.remote())["down"] == {}
    with Client() as client:
        assert len(client.generate([1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2

    # The router gone for good: the next start keeps the (built) replicas and makes a router
    # whose first health check comes only after the bound.
    ray.kill(deployment.router)
    checks_late = spec.model_copy(update={"health_period": 60.0})
    named = r"replica-0 \(starting\), replica-1 \(starting\) passed no health check within 2 s of the start"
    with pytest.raises(ClusterError, match=named):
        start_cluster(checks_late, ready_timeout=2.0)
    assert stop_cluster() == []  # the failed start stopped everything it started


def test_bad_input_through_the_client_is_a_clear_error(local_ray):
    """Invalid fields fail fast at the client with the field named; an empty prompt is
    refused by the replica and comes back as InvalidRequestError; a stream its consumer
    leaves is aborted without disturbing the next request; the cluster keeps serving."""
    deployment = start_cluster(ClusterSpec(num_replicas=1, replica=FAKE, store_path=str(local_ray / "s.db")))
    replica = deployment.replicas["replica-0"]
    client = Client()
    with pytest.raises(InvalidRequestError, match="temperature"):
        client.generate([1], temperature=-1)
    with pytest.raises(InvalidRequestError, match="max_token"):
        client.generate([1], max_token=3)
    with pytest.raises(InvalidRequestError, match="prompt"):
        client.generate([], max_tokens=3)
    with pytest.raises(InvalidRequestError, match="exceeds"):
        client.generate([1] * 10, max_tokens=1000)
    left = client.stream([5, 6], max_tokens=200, ignore_eos=True)
    next(left)
    left.close()  # aborts it; the replica's final event for it must be dropped quietly
    wait_until(lambda: ray.get(replica.health.remote()).running == 0, what="the left stream's abort")
    assert client.generate([1, 2], max_tokens=3, ignore_eos=True).finish_reason == "length"


def test_cluster_config_errors(local_ray):
    """Unknown routing or batching policy and zero replicas are refused before any actor starts."""
    with pytest.raises(ValueError, match="round_robin"):
        start_cluster(ClusterSpec(num_replicas=1, replica=FAKE, routing_policy="fastest"))
    with pytest.raises(ValueError):
        ClusterSpec(num_replicas=0)
    with pytest.raises(ValueError, match="batching policy"):
        ReplicaConfig(engine=EngineConfig(policy="fifo"), fake_step_seconds=0.01)


def test_unreachable_address_fails_fast():
    """A dead address is a one-line ClusterError within seconds, not a hang."""
    ray.shutdown()  # the module's local instance, if an earlier test started it: connect would keep it
    start = time.monotonic()
    with pytest.raises(ClusterError, match="cannot reach"):
        connect("127.0.0.1:1")
    assert time.monotonic() - start < 10


def test_replicas_spread_over_nodes():
    """On a head + 2 worker cluster, two replicas land on two different nodes and serve."""
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the module's local instance, if an earlier test started it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="slotserve", log_to_driver=False)
        deployment = start_cluster(ClusterSpec(num_replicas=2, replica=FAKE, store_path="/tmp/slotserve-multinode.db"))
        infos = ray.get([r.info.remote() for r in deployment.replicas.values()], timeout=120)
        assert len({i.node_id for i in infos}) == 2
        with Client() as client:
            results = [client.generate([i + 1, 2], max_tokens=4, ignore_eos=True) for i in range(6)]
        assert all(len(r.token_ids) == 4 for r in results)
        assert {r.replica_id for r in results} == {"replica-0", "replica-1"}
    finally:
        stop_cluster()
        ray.shutdown()
        cluster.shutdown()


DRIVER = textwrap.dedent("""
    import sys, ray
    from cluster.deploy import ClusterSpec, start_cluster
    from cluster.driver import run_workload
    from replica import EngineConfig
    from replica.serving.loop import ReplicaConfig
    from workloads import bursty_mix
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    spec = ClusterSpec(num_replicas=1, store_path=sys.argv[1],
                       replica=ReplicaConfig(engine=EngineConfig(num_slots=4), fake_step_seconds=0.01))
    d = start_cluster(spec)
    print("started", flush=True)
    run_workload(d, bursty_mix(num_requests=400, rate=20.0), name="killed", config={}, batching_policy="continuous",
                 routing_policy="least_loaded", progress=False)
""")


def recorded(path) -> int:
    """Request rows in the store file so far (none before the driver has made it)."""
    try:
        with sqlite3.connect(path) as conn:
            return conn.execute("select count(*) from requests").fetchone()[0]
    except sqlite3.OperationalError:  # no file or no table yet
        return 0


def test_store_survives_a_killed_driver(tmp_path):
    """Kill the driver mid-run: the store file opens, the requests that finished are there,
    and the run reads as incomplete."""
    path = tmp_path / "killed.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(path)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout.readline().strip() == "started"
        wait_until(lambda: recorded(path) >= 32, 120, "32 request rows in the store", every=0.5)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    store = MetricsStore(path)
    (run,) = store.runs()
    assert run["status"] != "complete"
    traces = store.traces(run["run_id"])
    assert 32 <= len(traces) < 400 and all(t.num_output_tokens > 0 for t in traces)


@pytest.mark.slow
def test_default_model_cluster_matches_single_engine(local_ray):
    """2 replicas of SmolLM2 behind the router, 20 concurrent streamed requests: every one
    completes, greedy outputs equal a single in-process engine's, and tokens arrive one by one."""
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(20)]
    config = EngineConfig(num_slots=8, max_seq_len=256, dtype="float32")
    deployment = start_cluster(  # held: the router and replicas live as long as their deployment
        ClusterSpec(num_replicas=2, replica=ReplicaConfig(engine=config), store_path=str(local_ray / "s.db"))
    )
    client = Client()

    async def one(prompt):
        events = [e async for e in client.astream(prompt, max_tokens=12, ignore_eos=True)]
        return events

    async def main():
        return await asyncio.gather(*[one(p) for p in prompts])

    results = asyncio.run(asyncio.wait_for(main(), 600))
    expected = Engine(config).generate(prompts, {"max_tokens": 12, "ignore_eos": True})
    for events, want in zip(results, expected):
        assert [t for e in events for t in e.token_ids] == want.token_ids
        assert events[-1].finished and events[-1].finish_reason == want.finish_reason.value
        # streamed: the client held the first token before the replica made the last one
        assert events[0].time < events[-1].made
    assert {e.replica_id for events in results for e in events} == set(deployment.replicas)


def test_async_burst_is_routed_in_one_call_per_loop_turn(local_ray):
    """Requests an async client routes in the same event-loop turn go to the router in one
    admit_many call: each still gets its own decision (both replicas used, every one logged),
    and the burst costs one Ray call instead of one per request."""
    deployment = start_cluster(ClusterSpec(num_replicas=2, replica=FAKE, store_path=str(local_ray / "s.db")))
    with Client() as client:
        calls = []
        real = client.router.admit_many

        class Counting:
            def remote(self, routes, subscriber):
                calls.append(len(routes))
                return real.remote(routes, subscriber)

        client.router.admit_many = Counting()

        async def burst():
            return await asyncio.gather(*[client.agenerate([i + 1], max_tokens=2, ignore_eos=True) for i in range(6)])

        results = asyncio.run(asyncio.wait_for(burst(), 120))
    assert calls == [6]
    assert {r.replica_id for r in results} == {"replica-0", "replica-1"}
    assert all(len(r.token_ids) == 2 for r in results)
    wait_until(  # completions reach the router from the replicas, on their own time
        lambda: sum(r["in_flight"] for r in ray.get(deployment.router.status.remote())["replicas"].values()) == 0,
        30,
        "completions to reach the router",
    )
