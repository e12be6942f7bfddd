"""Prefill/decode disaggregation on Ray: a prefill replica computes each request's prompt and
first token and hands it over; the client places it on the decode pool, whose replica fetches
the K/V from the prefill replica with a direct actor call, or computes them again when that
fails (the hand-over expired, the prefill replica gone), so no request is lost. The two-pool
router and its P/D decider without Ray first; then fake clusters (outputs equal a colocated
run's, transfers recorded in the store, a killed decode replica loses nothing, a drained replica
hands its decoding requests over with their K/V); then two real SmolLM2 replicas (slow)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from cluster.client import Client
from cluster.connection import ClusterError
from cluster.deploy import ClusterSpec, drain_replica, start_cluster, stop_cluster
from cluster.driver import run_workload
from experiments.experiment_report import transfer_seconds
from metrics.store import MetricsStore
from protocol.clock import FakeClock
from protocol.handover import KvLink
from protocol.messages import LoadReport
from protocol.routing import RouteRequest
from replica import Engine, EngineConfig
from replica.model.fake import DEFAULT_KV_BYTES_PER_TOKEN, ScriptedFakeRunner
from replica.serving.loop import ReplicaConfig
from router.pd_router import PdPools, PdRouter
from sim.disaggregation import SimPools
from tests.waiting import wait_until
from workloads import bursty_mix

FAKE = ReplicaConfig(engine=EngineConfig(num_slots=4, max_seq_len=256), fake_step_seconds=0.005)
THRESHOLD = 32  # prompts from this many tokens are disaggregated
ROLES = {"replica-0": "prefill", "replica-1": "decode", "replica-2": "decode"}


def report(replica_id: str, running: int = 0, prefill_pending: int = 0) -> LoadReport:
    return LoadReport(replica_id, 0, running, 8 - running, 8, 4096, time.time(), prefill_pending)


def test_two_pool_router_sends_long_prompts_to_prefill_and_moves_to_decode():
    """llm-d's threshold: a long prompt goes to the prefill pool, a short one to a decode
    replica (colocated); a request moved off any replica (handed over, or lost) goes to the
    decode pool only, and with no decode replica up it is refused to wait for one; a new
    request then still goes to the prefill pool. The queue-aware decider keeps a long prompt
    colocated on an idle decode replica, and on a busy one when the pools' link (an experiment's
    `kv_link`, the same pools simulated and on Ray) is too slow for its K/V."""
    router = PdRouter(list(ROLES), PdPools(ROLES, "threshold", THRESHOLD), policy="least_loaded", clock=FakeClock())
    for replica_id in ROLES:
        router.report(report(replica_id))
    assert router.route(RouteRequest("long", THRESHOLD, 8)).replica_id == "replica-0"
    assert router.route(RouteRequest("short", THRESHOLD - 1, 8)).replica_id in ("replica-1", "replica-2")
    moved = router.route(RouteRequest("long", THRESHOLD, 8, moved_from="replica-0"))
    assert moved.replica_id in ("replica-1", "replica-2") and router.load.owner("long") == moved.replica_id
    assert (router.disaggregated, router.colocated) == (1, 1)
    router.mark_down("replica-1", "lost")
    router.mark_down("replica-2", "lost")
    with pytest.raises(Exception, match="no decode-pool replica is up"):
        router.route(RouteRequest("short", 4, 8, moved_from="replica-1"))
    assert router.route(RouteRequest("new", 4, 8)).replica_id == "replica-0"

    aware = PdRouter(list(ROLES), PdPools(ROLES, "queue_aware", THRESHOLD, DEFAULT_KV_BYTES_PER_TOKEN))
    for replica_id in ROLES:
        aware.report(report(replica_id))
    assert aware.route(RouteRequest("idle-decode", 2000, 8)).replica_id != "replica-0"
    for replica_id in ("replica-1", "replica-2"):
        aware.report(report(replica_id, running=8))
    assert aware.route(RouteRequest("busy-decode", 2000, 8)).replica_id == "replica-0"
    slow_link = KvLink(bandwidth_bytes_per_s=1e7, latency_s=0.01)  # 2000 tokens' K/V take 4.6 s on it
    simulated = SimPools(prefill_replicas=1, decider="queue_aware", threshold=THRESHOLD, link=slow_link)
    on_ray = ClusterSpec(
        prefill_replicas=1, decode_replicas=2, pd_decider="queue_aware", pd_threshold=THRESHOLD, kv_link=slow_link
    )
    assert simulated.pd_pools(list(ROLES)) == on_ray.pd_pools()  # the simulation and Ray decide alike
    slow = PdRouter(list(ROLES), on_ray.pd_pools())
    for replica_id in ROLES:
        slow.report(report(replica_id, running=0 if replica_id == "replica-0" else 8))
    assert slow.route(RouteRequest("busy-decode", 2000, 8)).replica_id != "replica-0"


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module's clusters: each test starts its own and stops it."""
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def local_ray(ray_local, tmp_path):
    yield tmp_path
    stop_cluster()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 8 to 110 tokens: about half below THRESHOLD."""
    return [[(seed + 7 * i + 3 * j) % 1000 for j in range(8 + (i * 37) % 103)] for i in range(n)]


def serve(prompts_: list[list[int]], max_tokens: int, timeout: float = 240) -> list:
    """Every prompt streamed at once through a fresh client; their Results."""
    client = Client()

    async def all_of_them():
        return await asyncio.gather(
            *[client.agenerate(p, max_tokens=max_tokens, ignore_eos=True, timeout=timeout) for p in prompts_]
        )

    try:
        return asyncio.run(all_of_them())
    finally:
        client.close()


def expected(prompts_: list[list[int]], n: int) -> list[list[int]]:
    fake = ScriptedFakeRunner(FakeClock())
    return [fake.continuation(p, n) for p in prompts_]


def pd_spec(store, replica: ReplicaConfig = FAKE, threshold: int = THRESHOLD) -> ClusterSpec:
    """1 prefill + 1 decode replica."""
    return ClusterSpec(
        prefill_replicas=1, decode_replicas=1, pd_threshold=threshold, replica=replica, store_path=str(store)
    )


def test_disaggregated_outputs_equal_colocated_and_transfers_are_recorded(local_ray, capsys):
    """The same 16 prompts on one colocated replica and on 1 prefill + 1 decode replica give
    the same tokens (the fake's undisturbed sequences); each prompt from the threshold up was
    handed over with its K/V (tokens x the fake's bytes per token, fetched in measured
    seconds), the rest served whole on the decode replica. A driven run records each
    hand-over's bytes and seconds in the store's migrations table, which an experiment's table
    gives as the run's mean hand-over time."""
    ps = prompts(16)
    deployment = start_cluster(ClusterSpec(num_replicas=1, replica=FAKE, store_path=str(local_ray / "c.db")))
    colocated = [r.token_ids for r in serve(ps, 12)]
    assert colocated == expected(ps, 12)
    stop_cluster()
    del deployment

    store_path = local_ray / "pd.db"
    deployment = start_cluster(pd_spec(store_path))
    # A client routing by itself knows one pool: it is refused, naming the roles.
    with pytest.raises(ClusterError, match=r'routing="local" .* \(replica-0: prefill, replica-1: decode\)'):
        Client(routing="local")
    results = serve(ps, 12)
    assert [r.token_ids for r in results] == colocated
    for p, r in zip(ps, results):
        assert r.finish_reason == "length" and r.replica_id == "replica-1"
        if len(p) < THRESHOLD:
            assert r.migrations == []
            continue
        (move,) = r.migrations
        assert (move.from_replica, move.to_replica, move.tokens_carried) == ("replica-0", "replica-1", 1)
        assert move.kv_bytes == len(p) * DEFAULT_KV_BYTES_PER_TOKEN and 0 < move.kv_seconds < 30, move
    status = ray.get(deployment.router.status.remote())
    assert status["disaggregated"] == sum(len(p) >= THRESHOLD for p in ps) and status["colocated"] > 0
    from cli.main import main

    capsys.readouterr()
    assert main(["status"]) == 0  # `slotserve status` names the pools and counts what the decider did
    assert (
        f"pools: prefill replica-0; decode replica-1  decider: threshold  disaggregated: {status['disaggregated']}  "
        f"colocated: {status['colocated']}" in capsys.readouterr().out
    )

    workload = bursty_mix(num_requests=24, rate=50.0, seed=3)
    run_id = run_workload(
        deployment, workload, name="pd", config={}, batching_policy="continuous", routing_policy="least_loaded",
        progress=False,
    )  # fmt: skip
    store = MetricsStore(store_path)
    traces = {t.request_id: t for t in store.traces(run_id)}
    assert len(traces) == 24 and all(t.finish_reason == "length" for t in traces.values())
    moves = store.migrations(run_id)
    long = {rid for rid, t in traces.items() if t.prompt_len >= THRESHOLD}
    assert {m["request_id"] for m in moves} == long and len(moves) == len(long) > 0
    for m in moves:
        assert m["kv_bytes"] == traces[m["request_id"]].prompt_len * DEFAULT_KV_BYTES_PER_TOKEN and m["kv_seconds"] > 0
    per_request = [(m["kv_bytes"], m["kv_seconds"]) for m in moves]
    print(f"\nfake hand-overs (bytes, seconds): {per_request}")
    # An experiment's table gives the run's mean fetch as its hand-over time.
    assert transfer_seconds(store, run_id) == pytest.approx(sum(s for _, s in per_request) / len(per_request))


def test_expired_hand_overs_are_computed_again(local_ray):
    """A hand-over that waited past its prefill replica's `handover_ttl` is gone when the
    decode replica asks: the decode replica computes the K/V again from the tokens delivered,
    and the outputs are the same; the move records the failed fetch (no bytes) and why."""
    ps = [p for p in prompts(8, seed=5) if len(p) >= THRESHOLD]
    start_cluster(pd_spec(local_ray / "s.db", FAKE.model_copy(update={"handover_ttl": 1e-9})))
    results = serve(ps, 10)
    assert [r.token_ids for r in results] == expected(ps, 10)
    # As in the test above, a prompt routed while the prefill replica's health answer was late
    # (a loaded machine) is served colocated, with no move; every hand-over failed its fetch.
    handed_over = [r for r in results if r.migrations]
    assert len(handed_over) >= len(results) // 2 > 0
    for r in handed_over:
        (move,) = r.migrations
        assert move.kv_bytes == 0 and move.kv_seconds is not None and "computed again" in move.reason, move


def test_a_hand_over_waits_for_the_decode_replica_ray_restarts(local_ray):
    """Long prompts sent while the only decode replica is down (killed, Ray restarting it) are
    prefilled and handed over; once handed over a request is a moved one, so the router's
    refusal ("no decode-pool replica is up") makes it wait for the restarted replica instead of
    failing as a new request would, and every output is the undisturbed one."""
    ps = [p for p in prompts(8, seed=7) if len(p) >= THRESHOLD][:3]
    deployment = start_cluster(pd_spec(local_ray / "s.db"))
    ray.kill(deployment.replicas["replica-1"], no_restart=False)
    ray.get(deployment.router.replica_lost.remote("replica-1", "killed by the test"))
    results = serve(ps, 10)
    assert [r.token_ids for r in results] == expected(ps, 10)
    for r in results:
        assert r.replica_id == "replica-1" and r.migrations[0].from_replica == "replica-0", r.migrations


@pytest.mark.timeout(600)
def test_a_decode_replica_killed_during_hand_overs_loses_no_request(local_ray):
    """60 long-prompt requests streamed through 1 prefill + 1 decode replica; the decode
    replica is killed while hand-overs come in and requests decode there. Ray restarts it; the
    hand-overs caught in between wait for it and fetch their K/V then (or compute them), the
    requests it was decoding move back to it with their tokens: every request completes with
    exactly the undisturbed tokens."""
    ps = [p for p in prompts(120, seed=11) if len(p) >= THRESHOLD][:60]
    deployment = start_cluster(pd_spec(local_ray / "s.db"))
    decode = deployment.replicas["replica-1"]
    client = Client()
    outcome: dict[str, list] = {}

    async def chaos():
        runs = [
            asyncio.ensure_future(client.agenerate(p, max_tokens=40, ignore_eos=True, timeout=300))
            for p in ps
        ]  # fmt: skip
        await asyncio.to_thread(
            wait_until, lambda: ray.get(decode.health.remote()).running >= 4, 120, "decodes on the decode replica"
        )
        ray.kill(decode, no_restart=False)
        outcome["results"] = await asyncio.gather(*runs, return_exceptions=True)

    try:
        asyncio.run(chaos())
    finally:
        client.close()
    results = outcome["results"]
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert [r.token_ids for r in results] == expected(ps, 40)
    assert all(r.finish_reason == "length" for r in results)
    lost = [m for r in results for m in r.migrations if m.from_replica == "replica-1"]
    assert lost, "no request was decoding on the killed replica"
    fetched = [m for r in results for m in r.migrations if m.from_replica == "replica-0" and m.kv_bytes > 0]
    assert fetched
    print(f"\nchaos: {len(lost)} moved off the killed decode replica, {len(fetched)} hand-overs with K/V")


DRAINED = ReplicaConfig(engine=EngineConfig(num_slots=8, max_seq_len=512), fake_step_seconds=0.02)
DRAIN_PROMPTS = [[(5 * i + j) % 1000 for j in range(64 + 8 * i)] for i in range(8)]
DRAIN_TOKENS = 150


def drain_under_load(store_path, move_kv: bool) -> tuple[list, dict[str, int], int]:
    """The 8 prompts streamed through two mixed replicas (4 each), and replica-0 drained with a
    0.2 s timeout once its requests decode (none can finish by then): the results, the drain's
    counts, and the tokens computed again, counted from every step the run recorded (prefill
    tokens beyond each prompt's once)."""
    deployment = start_cluster(ClusterSpec(num_replicas=2, replica=DRAINED, store_path=str(store_path)))
    store, replica = deployment.store, deployment.replicas["replica-0"]
    run_id = ray.get(store.begin_run.remote("drain", {}, "continuous", "least_loaded", 0))
    ray.get([a.set_run.remote(run_id) for a in [deployment.router, *deployment.replicas.values()]])
    client = Client()

    async def drained():
        runs = [
            asyncio.ensure_future(client.agenerate(p, max_tokens=DRAIN_TOKENS, ignore_eos=True, timeout=300))
            for p in DRAIN_PROMPTS
        ]  # fmt: skip
        await asyncio.to_thread(
            wait_until, lambda: ray.get(replica.info.remote()).load.decode_tokens_made >= 40, 120, "replica-0 to decode"
        )
        counts = await asyncio.to_thread(drain_replica, deployment, "replica-0", 0.2, move_kv)
        return counts, await asyncio.gather(*runs)

    try:
        counts, results = asyncio.run(drained())
    finally:
        client.close()
    ray.get(deployment.replicas["replica-1"].flush.remote())  # replica-0 flushed before it stopped
    computed = sum(step["num_prefill_tokens"] for step in ray.get(store.steps.remote(run_id)))
    stop_cluster()
    return results, counts, computed - sum(map(len, DRAIN_PROMPTS))


@pytest.mark.timeout(600)
def test_a_drain_moves_decoding_requests_kv_instead_of_recomputing(local_ray):
    """The same traffic drained twice: with K/V moved (the default), every request replica-0 was
    decoding moves to replica-1 with a hand-over of its K/V (prompt and output but the last
    token, at the fake's bytes per token), fetched from replica-0 before it stops, so nothing is
    computed again; with a recompute-drain each moved request computes its prompt and output
    again. Either way every output is the undisturbed run's."""
    recomputed = {}
    for move_kv in (True, False):
        results, counts, recomputed[move_kv] = drain_under_load(local_ray / f"drain-{move_kv}.db", move_kv)
        assert all(r.finish_reason == "length" for r in results)
        assert [r.token_ids for r in results] == expected(DRAIN_PROMPTS, DRAIN_TOKENS)
        moves = {r.request_id: (p, r.migrations) for p, r in zip(DRAIN_PROMPTS, results) if r.migrations}
        assert len(moves) == counts["migrated"] == 4 and counts["finished"] == 0
        assert counts["kv_moved"] == (4 if move_kv else 0)
        for p, (move,) in moves.values():
            assert (move.from_replica, move.to_replica) == ("replica-0", "replica-1")
            if move_kv:
                assert move.kv_bytes == (len(p) + move.tokens_carried - 1) * DEFAULT_KV_BYTES_PER_TOKEN, move
                assert 0 < move.kv_seconds < 30 and "computed again" not in move.reason
            else:
                assert move.kv_bytes == 0 and move.kv_seconds is None  # no fetch tried
        if not move_kv:
            assert recomputed[False] == sum(len(p) + move.tokens_carried for p, (move,) in moves.values())
            prompts_moved = sum(len(p) for p, _ in moves.values())
        kv_bytes = sum(move.kv_bytes for _, (move,) in moves.values())
        print(f"\ndrain moving K/V={move_kv}: {kv_bytes:,d} K/V bytes fetched, {recomputed[move_kv]} tokens recomputed")
    assert recomputed[True] == 0 < recomputed[False]
    print(f"a recompute-drain computed again {prompts_moved} prompt tokens (and their outputs); a K/V drain none")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_model_disaggregated_equals_colocated(local_ray):
    """SmolLM2-135M (fp32, paged cache with prefix caching, chunked prefill): the correctness
    suite's prompts on 1 prefill + 1 decode replica (every prompt disaggregated) give the greedy
    and the seeded tokens of one colocated engine; each hand-over sends the prompt's K/V, 46,080 bytes a
    token (30 layers x 3 K/V heads x 64 x K and V x 4 bytes), and its bytes and seconds are
    printed."""
    from replica.model.loader import load_hf_model
    from tests.test_correctness import make_prompts

    _, tok = load_hf_model("smollm2-135m")
    cases = make_prompts(tok)
    engine = EngineConfig(
        policy="chunked", token_budget=64, num_slots=4, max_seq_len=256, dtype="float32", kv_cache="paged",
        block_size=16, prefix_caching=True,
    )  # fmt: skip
    replica = ReplicaConfig(engine=engine)

    seeded = {"temperature": 0.9, "top_p": 0.95}

    def greedy_and_seeded() -> list:
        client = Client()

        async def all_of_them():
            greedy = [client.agenerate(p, max_tokens=n, timeout=300) for p, n in cases]
            sampled = [
                client.agenerate(p, max_tokens=n, seed=7 + i, timeout=300, **seeded) for i, (p, n) in enumerate(cases)
            ]
            return await asyncio.gather(*greedy, *sampled)

        try:
            return asyncio.run(all_of_them())
        finally:
            client.close()

    # One colocated engine, in process (a Ray replica is token-equal to it: test_cluster.py's
    # test_default_model_cluster_matches_single_engine), the same requests and params.
    params = [{"max_tokens": n} for _, n in cases]
    params += [{"max_tokens": n, "seed": 7 + i, **seeded} for i, (_, n) in enumerate(cases)]
    colocated = [c.token_ids for c in Engine(engine).generate([p for p, _ in cases] * 2, params)]
    start_cluster(pd_spec(local_ray / "pd.db", replica, threshold=0))
    results = greedy_and_seeded()
    assert [r.token_ids for r in results] == colocated
    results = results[: len(cases)]  # the greedy ones
    print()
    for (p, _), r in zip(cases, results):
        if not r.migrations:  # its first token ended it (EOS): nothing to hand over
            assert len(r.token_ids) == 1
            continue
        (move,) = r.migrations
        assert move.kv_bytes == len(p) * 46_080, move
        print(f"prompt {len(p):3d} tokens: hand-over {move.kv_bytes:>9,d} bytes in {move.kv_seconds * 1e3:6.1f} ms")
