"""Reliability on a real local Ray instance (fake model, so outputs are exact functions of the
sequence): a replica killed mid-stream loses nothing and duplicates nothing, and comes back;
a flood is refused fast and bounded; a drained replica hands its requests on; a duplicate id
fails alone; never-closed clients cannot wedge a replica; the cluster refuses what Ray cannot
place and recovers from a dead router; status survives a dead replica."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import ray

from cluster.client import Client, RequestTimeoutError
from cluster.deploy import ClusterError, ClusterSpec, cluster_status, drain_replica, start_cluster, stop_cluster
from protocol.errors import OverloadedError
from protocol.replicas import ReplicaInfo, Unreachable
from replica import EngineConfig
from replica.model.fake import ScriptedFakeRunner
from replica.serving.loop import ReplicaConfig
from router.actor import ROUTER_ACTOR_NAME
from router.errors import RoutingError
from tests.waiting import wait_until

FAKE = ScriptedFakeRunner(None)  # what an undisturbed run of the fake model makes: FAKE.continuation

pytestmark = pytest.mark.timeout(600)


def fake(step: float = 0.01, slots: int = 4, **kw) -> ReplicaConfig:
    return ReplicaConfig(engine=EngineConfig(num_slots=slots, max_seq_len=256), fake_step_seconds=step, **kw)


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def cluster(ray_local, tmp_path):
    def start(**kw):
        kw.setdefault("replica", fake())
        kw.setdefault("health_period", 0.5)
        return start_cluster(ClusterSpec(store_path=str(tmp_path / "s.db"), **kw))

    yield start
    stop_cluster()


def in_flight(deployment) -> int:
    return sum(r["in_flight"] for r in ray.get(deployment.router.status.remote())["replicas"].values())


def running(deployment, replica_id: str) -> int:
    return ray.get(deployment.replicas[replica_id].health.remote(), timeout=30).running


def made(replica) -> int:
    """Output tokens the replica's requests have made so far."""
    return ray.get(replica.info.remote(), timeout=30).load.decode_tokens_made


async def stream_all(client: Client, prompts: list[list[int]], n: int) -> list:
    return await asyncio.gather(*[client.agenerate(p, max_tokens=n, ignore_eos=True) for p in prompts])


def kill_mid_stream(victim, prompts: list[list[int]], n: int) -> list:
    """Stream `n` tokens for each prompt and kill `victim` (Ray restarts it) once it has made
    tokens; every request must complete with exactly the tokens of an undisturbed run (none
    lost, none twice). Returns the moves."""

    async def run():
        with Client() as client:
            task = asyncio.ensure_future(stream_all(client, prompts, n))
            await asyncio.to_thread(wait_until, lambda: made(victim) >= 8, what="the victim to stream tokens")
            ray.kill(victim, no_restart=False)
            return await asyncio.wait_for(task, 180)

    results = asyncio.run(run())
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length", result.error
        assert result.token_ids == FAKE.continuation(prompt, n)
    return [m for r in results for m in r.migrations]


def test_killed_replica_mid_stream_resumes_exactly_and_rejoins(cluster):
    """Kill one of three replicas while 24 streams run: every request completes exactly, the
    moves are recorded with the tokens carried, the router's books return to zero, and Ray's
    restart of the replica rejoins the rotation once its health check passes."""
    deployment = cluster(num_replicas=3)
    moves = kill_mid_stream(deployment.replicas["replica-1"], [[i + 1, 7, 3] for i in range(24)], 80)
    assert moves and all(m.from_replica == "replica-1" and m.to_replica != "replica-1" for m in moves)
    assert any(m.tokens_carried > 0 for m in moves)
    wait_until(lambda: in_flight(deployment) == 0, what="in-flight counts to drain")
    wait_until(
        lambda: "replica-1" not in ray.get(deployment.router.status.remote())["down"], what="replica-1 to rejoin"
    )
    with Client() as client:  # it serves again
        ids = {client.generate([9, i], max_tokens=3, ignore_eos=True).replica_id for i in range(9)}
    assert "replica-1" in ids


def test_requests_of_a_killed_sole_replica_wait_for_its_restart(cluster):
    """The only replica killed mid-stream: while Ray restarts it the router has no replica up
    and refuses every move with a retry-after; the moved requests wait that out and resume on
    the restarted replica exactly, none lost."""
    deployment = cluster(num_replicas=1)
    moves = kill_mid_stream(deployment.replicas["replica-0"], [[i + 1, 5] for i in range(4)], 60)
    assert moves and all(m.to_replica == "replica-0" for m in moves)


def test_duplicate_request_id_in_a_burst_fails_only_the_duplicate(cluster):
    """Two requests with one id in a burst routed in one call: the second gets RoutingError, the
    other 20 complete, and no in-flight count leaks."""
    deployment = cluster(num_replicas=2)

    async def burst(client):
        ids = [f"r{i}" for i in range(20)] + ["r3"]
        coros = [client.agenerate([i + 1], request_id=rid, max_tokens=4, ignore_eos=True) for i, rid in enumerate(ids)]
        return await asyncio.gather(*coros, return_exceptions=True)

    with Client() as client:
        out = asyncio.run(burst(client))
    assert [type(o).__name__ for o in out].count("RoutingError") == 1 and isinstance(out[-1], RoutingError)
    assert all(o.finish_reason == "length" for o in out[:-1])
    wait_until(lambda: in_flight(deployment) == 0, what="in-flight counts to drain")


def test_never_closed_clients_cannot_wedge_a_replica(cluster):
    """1,100 event streams opened and never read or closed (Ray runs at most 1,000 calls of an
    async actor at once): the replica keeps at most max_subscribers open and still answers; a
    Client that is dropped without close() has its stream closed when it is collected."""
    deployment = cluster(num_replicas=1, replica=fake(max_subscribers=64))
    replica = deployment.replicas["replica-0"]

    def open_streams() -> int:
        return ray.get(replica.health.remote(), timeout=30).subscribers

    client = Client()
    client.generate([3], max_tokens=2, ignore_eos=True)
    assert open_streams() == 1
    del client
    gc.collect()
    wait_until(lambda: open_streams() == 0, 30, "the dropped client's stream to close")

    streams = [replica.events.remote(f"leaked-{i}") for i in range(1100)]
    ended, _ = ray.wait([s.completed() for s in streams], num_returns=1100 - 64, timeout=120)
    assert len(ended) == 1100 - 64  # each stream past the bound ended the one idle longest
    start = time.monotonic()
    assert open_streams() <= 64 and time.monotonic() - start < 10
    with Client() as client:
        assert client.generate([1, 2], max_tokens=3, ignore_eos=True).finish_reason == "length"
    del streams


def test_cluster_refuses_what_ray_cannot_place(ray_local):
    """More replicas than CPUs is a ClusterError at once naming what fits, not a pending actor."""
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"5 replicas x 1 CPU need 5 CPUs; this Ray cluster has 4: use --replicas 4"):
        start_cluster(ClusterSpec(num_replicas=5, replica=fake()))
    assert time.monotonic() - start < 30


def test_up_after_the_router_died_recovers_keeping_live_replicas(cluster):
    """The router killed for good: `up` again starts a router around the live replicas and the
    store (no ActorAlreadyExistsError), and requests are served."""
    first = cluster(num_replicas=2)
    kept = first.replicas["replica-0"]._actor_id
    ray.kill(first.router)
    wait_until(
        lambda: ROUTER_ACTOR_NAME not in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)},
        what="the killed router's name to be free",
    )
    second = cluster(num_replicas=2)
    assert second.replicas["replica-0"]._actor_id == kept
    with Client() as client:
        assert client.generate([5], max_tokens=3, ignore_eos=True).finish_reason == "length"


def test_flood_is_refused_fast_bounded_and_served_after(cluster):
    """400 requests at once against 2 replicas x 4 slots with bounded queues: every request
    completes exactly or is refused with OverloadedError (retry-after given) within a second;
    no replica queue passes its bound; the cluster serves normally right after."""
    deployment = cluster(num_replicas=2, replica=fake(step=0.005, max_queue=8), max_in_flight_per_replica=12)

    async def flood(client):
        async def one(i):
            start = time.monotonic()
            try:
                return i, await client.agenerate([i + 1, 2], max_tokens=10, ignore_eos=True), None
            except OverloadedError as err:
                return i, err, time.monotonic() - start

        return await asyncio.gather(*[one(i) for i in range(400)])

    with Client() as client:
        out = asyncio.run(flood(client))
        done = [(i, r) for i, r, waited in out if waited is None]
        refused = [(err, waited) for _, err, waited in out if waited is not None]
        assert len(done) >= 16 and len(refused) >= 300 and len(done) + len(refused) == 400
        assert all(r.token_ids == FAKE.continuation([i + 1, 2], 10) for i, r in done)
        assert all(err.retry_after > 0 and waited < 5.0 for err, waited in refused)
        infos = [ray.get(r.info.remote()) for r in deployment.replicas.values()]
        assert all(i.peak_queued <= 8 for i in infos)
        assert ray.get(deployment.router.status.remote())["rejected"] + sum(i.rejected for i in infos) == len(refused)
        assert client.generate([1, 2, 3], max_tokens=5, ignore_eos=True).token_ids == ScriptedFakeRunner(
            None
        ).continuation([1, 2, 3], 5)


def test_timeout_and_cancel_abort_on_the_replica(cluster):
    """A request past its timeout raises RequestTimeoutError and its slot is freed at once; so is
    an async request cancelled by its caller."""
    deployment = cluster(num_replicas=1, replica=fake(step=0.02))
    replica = deployment.replicas["replica-0"]
    with Client() as client:
        with pytest.raises(RequestTimeoutError, match="timeout=0.3"):
            client.generate([1], max_tokens=200, ignore_eos=True, timeout=0.3)
        wait_until(lambda: ray.get(replica.health.remote()).running == 0, 5, "the timed-out request's slot")

        async def cancel():
            task = asyncio.ensure_future(client.agenerate([2], max_tokens=200, ignore_eos=True))
            await asyncio.to_thread(wait_until, lambda: ray.get(replica.health.remote()).running == 1, 30, "it to run")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(cancel())
        wait_until(lambda: ray.get(replica.health.remote()).running == 0, 5, "the cancelled request's slot")


def test_drained_replica_finishes_or_hands_on_and_loses_nothing(cluster, capsys):
    """Drain one of two replicas while 16 long streams run: it admits nothing new, what does not
    finish within the timeout moves to the other replica, and every stream completes exactly."""
    deployment = cluster(num_replicas=2, replica=fake(step=0.01))
    prompts = [[i + 3, 1] for i in range(16)]

    async def run():
        with Client() as client:
            task = asyncio.ensure_future(stream_all(client, prompts, 100))
            await asyncio.to_thread(wait_until, lambda: running(deployment, "replica-0") > 0, what="replica-0 to run")
            counts = await asyncio.to_thread(drain_replica, deployment, "replica-0", 0.3)
            return counts, await asyncio.wait_for(task, 120)

    counts, results = asyncio.run(run())
    assert counts["migrated"] > 0
    assert all(
        r.token_ids == FAKE.continuation(p, 100) and r.finish_reason == "length" for p, r in zip(prompts, results)
    )
    moves = [m for r in results for m in r.migrations]
    assert len(moves) == counts["migrated"] and all(m.to_replica == "replica-1" for m in moves)
    status = cluster_status(timeout=5)
    assert status["router"]["down"]["replica-0"] == "draining"
    dead, alive = status["replicas"]
    assert isinstance(dead, Unreachable) and isinstance(alive, ReplicaInfo)  # a dead replica is listed, not fatal
    from cli.main import main

    assert main(["status"]) == 0
    out = capsys.readouterr().out
    assert "replica-0" in out and "DEAD" in out and "not routed to: draining" in out and "ok (last step" in out


def test_down_during_a_run_lets_running_requests_finish(cluster):
    """`slotserve down` (stop_cluster with a drain timeout) while 10 streams run: every one
    finishes exactly; a request sent once draining has begun is refused as overloaded, not lost
    in a replica that is going away."""
    deployment = cluster(num_replicas=2, replica=fake(step=0.01))
    prompts = [[i + 1, 9] for i in range(10)]

    def draining() -> int:
        return sum(why == "draining" for why in ray.get(deployment.router.status.remote())["down"].values())

    async def run():
        with Client() as client:
            task = asyncio.ensure_future(stream_all(client, prompts, 60))
            await asyncio.to_thread(wait_until, lambda: in_flight(deployment) == 10, what="all 10 to be routed")
            down = asyncio.ensure_future(asyncio.to_thread(stop_cluster, 30.0))
            await asyncio.to_thread(wait_until, lambda: draining() == 2, what="both replicas to drain")
            with pytest.raises(OverloadedError, match="no replica is up"):
                await client.agenerate([4], max_tokens=2)
            results = await asyncio.wait_for(task, 120)
            return results, await down

    results, stopped = asyncio.run(run())
    assert all(
        r.token_ids == FAKE.continuation(p, 60) and r.finish_reason == "length" for p, r in zip(prompts, results)
    )
    assert len(stopped) == 4  # store, router, two replicas


HEAD = """
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
print(cluster.address, flush=True)
sys.stdin.readline()
cluster.shutdown()
"""
JOIN = """
import sys, ray
from cluster.client import connect

connect(sys.argv[1])
print("answer", ray.get(ray.remote(lambda: 42).remote(), timeout=60), flush=True)
"""


def test_explicit_address_of_a_token_auth_cluster_connects(tmp_path):
    """A cluster with Ray's token auth on, joined with an explicit address (as `--address`
    does) from a shell where only the token file is set (RAY_AUTH_MODE unset): slotserve sends
    the token, where ray.init alone fails with InvalidAuthToken."""
    import os
    import subprocess
    import sys
    import uuid

    token = tmp_path / "token"
    token.write_text(uuid.uuid4().hex * 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), RAY_AUTH_TOKEN_PATH=str(token), PYTHONPATH=os.getcwd())
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD],
        env={**env, "RAY_AUTH_MODE": "token"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = head.stdout.readline().strip()
        assert address, "the token-auth head did not start"
        joined = subprocess.run(
            [sys.executable, "-c", JOIN, address], env=env, capture_output=True, text=True, timeout=120
        )
        assert "answer 42" in joined.stdout, joined.stderr[-2000:]
    finally:
        head.communicate("\n", timeout=120)


def test_router_restarted_by_ray_is_retried_and_serves(cluster):
    """The router killed (Ray restarts it): the client's next requests wait for it with backoff
    instead of failing, and the restarted router routes on the replicas' fresh reports. It asks
    the replicas for their health before its first call, so its first answer already has both
    up (else a request arriving before its watcher's first round would be refused)."""
    # health rounds slower than a restart: a router that waited for its watcher's first round
    # would still hold both replicas starting when it first answers
    deployment = cluster(num_replicas=2, health_period=3.0)

    def answered() -> dict | None:
        """The restarted router's status (it has routed nothing yet; the killed one had)."""
        try:
            status = ray.get(deployment.router.status.remote(), timeout=10)
        except ray.exceptions.RayError:
            return None  # still restarting
        return status if status["routed"] == 0 else None

    with Client() as client:
        assert client.generate([1], max_tokens=2, ignore_eos=True).finish_reason == "length"
        ray.kill(deployment.router, no_restart=False)
        status = wait_until(answered, what="the restarted router to answer")
        assert status["down"] == {}, status["down"]
        results = [client.generate([i + 2], max_tokens=3, ignore_eos=True) for i in range(4)]
    assert all(r.token_ids == FAKE.continuation([i + 2], 3) for i, r in enumerate(results))
    wait_until(lambda: in_flight(deployment) == 0, what="the new router's books to settle")
