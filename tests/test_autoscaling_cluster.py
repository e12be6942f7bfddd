"""Autoscaling on a real local Ray instance (fake model, so outputs are exact functions of the
sequence): load grows the cluster through the controller (`cluster.autoscaler`) and quiet
drains it back to its minimum with no token lost or duplicated; a replica drained while its
requests run hands them on token-exact; `slotserve status` shows each replica's state and the
last decision; the decisions and cold starts land in the store."""

from __future__ import annotations

import asyncio

import pytest
import ray

from autoscaling.policies import AutoscaleConfig
from benchmarks.autoscaling_churn import churn_run
from benchmarks.reliability import FAKE
from cluster.autoscaler import autoscaler_status
from cluster.client import Client
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from replica import EngineConfig
from replica.serving.loop import ReplicaConfig
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def one_to_two(drain_timeout_s: float = 0.2, cooldown_s: float = 0.0, **params) -> AutoscaleConfig:
    """Ray Serve's rule between 1 and 2 replicas, deciding every 0.25 s: fast enough that a
    test sees a scale-up and a scale-down within seconds."""
    return AutoscaleConfig(
        policy="target_ongoing",
        min_replicas=1,
        max_replicas=2,
        cooldown_s=cooldown_s,
        period_s=0.25,
        drain_timeout_s=drain_timeout_s,
        params=params,
    )


def test_load_scales_up_and_quiet_drains_to_min_losing_no_token(ray_local):
    """A busy phase then a quiet one through a cluster of 1 to 3 replicas: it grows past one
    replica, drains back to one, and every request ends with exactly an undisturbed run's
    tokens; each started replica's cold start is measured in order (answered, first step,
    taking traffic) and every decision is recorded under the run."""
    stats = churn_run(cycles=1)
    status = stats.status
    assert stats.completed == stats.requests > 0, stats.errors[:3]
    assert stats.lost_tokens == stats.duplicated_tokens == stats.wrong_outputs == 0
    assert stats.peak_serving >= 2 and status.scale_ups >= 1 and status.scale_downs >= 1
    assert [r.state for r in status.replicas] == ["serving"], status.replicas  # back to min_replicas
    assert status.cold_starts and all(0 < c.loaded_s <= c.first_step_s <= c.ready_s for c in status.cold_starts)
    assert status.drained_finished + status.drained_moved >= stats.moved_requests
    assert stats.scaling_rows >= status.scale_ups + status.scale_downs and not status.errors


def test_a_replica_drained_under_load_hands_its_requests_on_exactly(ray_local, tmp_path, capsys):
    """Two replicas, each running two long streams, and a policy that wants one from the start:
    after its downscale delay (past the streams' start) the controller drains one while its
    requests run (they take 18 s, the delay 8 s from the controller's start, which start_cluster
    waits for); what does not finish within the drain timeout resumes on the other replica
    with no token lost or repeated, the decoding ones with their K/V.
    `slotserve status` then shows the replica left serving, the decision that drained and the
    requests moved with their K/V."""
    autoscale = one_to_two(target_ongoing_requests=100, downscale_delay_s=8.0, look_back_s=0.5)
    replica = ReplicaConfig(engine=EngineConfig(num_slots=4, max_seq_len=1024), fake_step_seconds=0.02)
    spec = ClusterSpec(
        num_replicas=2, replica=replica, store_path=str(tmp_path / "s.db"), health_period=0.25, autoscale=autoscale
    )
    prompts = [[i + 3, 1] for i in range(4)]
    try:
        start_cluster(spec)

        async def run():
            with Client() as client:
                return await asyncio.gather(*[client.agenerate(p, max_tokens=900, ignore_eos=True) for p in prompts])

        results = asyncio.run(run())
        assert all(
            r.token_ids == FAKE.continuation(p, 900) and r.finish_reason == "length" for p, r in zip(prompts, results)
        )
        moves = [m for r in results for m in r.migrations]
        assert moves and all(m.reason and m.to_replica != m.from_replica for m in moves)
        status = wait_until(
            lambda: (s := autoscaler_status()) and len(s.replicas) == 1 and s, 60, "the drained replica to leave"
        )
        assert status.scale_downs == 1 and status.drained_moved == len(moves)
        assert status.drained_kv_moved == sum(m.kv_seconds is not None for m in moves) > 0  # decoding: with K/V
        from cli.main import main

        assert main(["status"]) == 0
        out = capsys.readouterr().out
        assert "autoscaling: target_ongoing" in out and "serving" in out and "last decision" in out
        assert f"({status.drained_kv_moved} with their K/V)" in out
    finally:
        stop_cluster()


def test_experiment_file_states_an_autoscaled_cluster(tmp_path):
    """`[cluster] autoscale = { policy, min, max, ... }` is read as the plan's AutoscaleConfig
    (the policy's own parameters beside the bounds); a wrong key is refused at its line."""
    from experiments.plan import plan_experiment
    from workloads.experiment import ExperimentError

    def write(autoscale: str) -> str:
        path = tmp_path / "e.toml"
        path.write_text(
            'name = "auto"\n[workload]\nstandard = "bursty-mix"\nargs = { num_requests = 8 }\n'
            f'[cluster]\nreplicas = 1\nmodel = "fake"\nfake_step_seconds = 0.01\nautoscale = {autoscale}\n'
            '[sweep]\nbatching = ["continuous"]\nrouting = ["least_loaded"]\nseeds = [0]\n'
        )
        return str(path)

    plan = plan_experiment(write('{ policy = "target_ongoing", min = 1, max = 4, target_ongoing_requests = 3 }'))
    assert (plan.autoscale.policy, plan.autoscale.min_replicas, plan.autoscale.max_replicas) == ("target_ongoing", 1, 4)
    assert plan.autoscale.params == {"target_ongoing_requests": 3}
    with pytest.raises(ExperimentError, match="autoscale"):
        plan_experiment(write('{ policy = "target_ongoing", min = 1, max = 4, nope = 3 }'))


def test_added_replicas_hear_arrivals_survive_a_router_restart_and_leave_local_routers(ray_local, tmp_path):
    """Static batching, where a lone request runs only once the replica knows no more requests
    come: the replica the controller adds for three long requests warms up (its warm-up runs
    alone) and, with no word from a driver (as under `slotserve serve`), still waits for more
    requests after it; it hears each word the router is given from then on, and adding it
    twice changes nothing; a router Ray restarts is given it back by the controller and routes
    to it; and once it is drained away, a client routing locally forgets it."""
    autoscale = one_to_two(target_ongoing_requests=1, upscale_delay_s=0.0, downscale_delay_s=3.0, look_back_s=0.5)
    engine = EngineConfig(policy="static", num_slots=2, max_seq_len=1024)
    spec = ClusterSpec(
        num_replicas=1,
        replica=ReplicaConfig(engine=engine, fake_step_seconds=0.01),
        store_path=str(tmp_path / "s.db"),
        health_period=0.25,
        autoscale=autoscale,
    )
    try:
        router = start_cluster(spec).router

        def ask(method: str, *args):
            try:
                return ray.get(getattr(router, method).remote(*args), timeout=5)
            except ray.exceptions.RayError:  # the router is restarting
                return None

        def added_is_up() -> bool:
            return bool(ask("is_up", "replica-1"))

        async def run():
            with Client() as client, Client(routing="local") as local:
                long = [
                    asyncio.ensure_future(client.agenerate([i + 3, 1], max_tokens=900, ignore_eos=True))
                    for i in range(3)
                ]
                await asyncio.to_thread(wait_until, added_is_up, 120, "the added replica to serve")
                await router.add_replica.remote("replica-1", "slotserve-replica-1")  # the reconcile's, say
                assert await router.is_up.remote("replica-1")
                waiting = asyncio.ensure_future(client.agenerate([8, 8], max_tokens=4, ignore_eos=True))
                await asyncio.sleep(1.0)
                assert not waiting.done()  # a static batch of one waits for more requests to come
                await router.set_arrivals_done.remote(True)
                alone = await asyncio.wait_for(waiting, 30)
                assert alone.replica_id == "replica-1" and alone.finish_reason == "length"
                assert "replica-1" in local.local_router.replica_ids
                ray.kill(router, no_restart=False)
                fresh = lambda: (s := ask("status")) is not None and s["routed"] == 0  # noqa: E731
                await asyncio.to_thread(wait_until, fresh, 60, "Ray to restart the router")
                await asyncio.to_thread(wait_until, added_is_up, 60, "the restarted router to route to replica-1")
                assert all(r.finish_reason == "length" for r in await asyncio.gather(*long))
                await asyncio.to_thread(
                    wait_until, lambda: local.local_router.replica_ids == ["replica-0"], 60, "the drained replica to go"
                )

        asyncio.run(run())
        status = autoscaler_status()
        assert status.scale_ups == status.scale_downs == 1, status
        assert all("restart" in e for e in status.errors), status.errors  # only decisions while the router restarted
    finally:
        stop_cluster()


def test_a_failed_sample_of_serves_replicas_loses_that_sample_only(monkeypatch):
    """Serve's controller failing to answer one sample (busy or restarting) costs the timeline
    that point, not the run: the sampler goes on and records each change after it."""
    from cluster import serve_baseline

    one, two = {"serving": 1, "starting": 0, "draining": 0}, {"serving": 1, "starting": 1, "draining": 0}
    answers = [RuntimeError("controller restarting"), one, RuntimeError("timed out"), two]

    def counts() -> dict[str, int]:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(serve_baseline, "_replica_counts", counts)

    async def sample() -> list:
        changes: list = []
        sampler = asyncio.ensure_future(serve_baseline._sample_replicas(0.001, changes))
        await asyncio.to_thread(wait_until, lambda: len(changes) >= 2 or sampler.done(), 10, "two samples", 0.005)
        sampler.cancel()
        return changes

    changes = asyncio.run(asyncio.wait_for(sample(), 10))
    assert [(c.current, c.desired) for c in changes] == [(1, 1), (1, 2)]


def test_ray_serve_autoscaler_grows_the_same_engine_and_its_replica_seconds_are_sampled(ray_local, tmp_path):
    """The Serve peer sized by Serve's own autoscaler, from a `target_ongoing` policy's
    parameters: a few seconds of bursty traffic grow it from one replica to two, every request
    ends with its tokens, and the replicas Serve's controller had are sampled every decision
    period into the run's scaling rows, which give its replica-seconds by slotserve's rule
    (the second replica may come up after the last arrival: Serve moves no queued request)."""
    from cluster.serve_baseline import SERVE_AUTOSCALER, ServeBaseline
    from cluster.store_actor import StoreActor
    from experiments.scaling_report import replica_timeline
    from metrics.store import MetricsStore
    from workloads import bursty_mix

    autoscale = one_to_two(
        drain_timeout_s=1.0,
        cooldown_s=AutoscaleConfig.model_fields["cooldown_s"].default,
        target_ongoing_requests=1,
        upscale_delay_s=0.0,
        downscale_delay_s=1.0,
        look_back_s=0.5,
    )
    replica = ReplicaConfig(engine=EngineConfig(num_slots=4, max_seq_len=256), fake_step_seconds=0.02)
    path = tmp_path / "serve.db"
    store_actor = StoreActor.remote(str(path))
    baseline = ServeBaseline(replica, 1, "serve_power_of_two", store_actor, num_cpus=0.25, autoscale=autoscale)
    try:
        workload = bursty_mix(num_requests=48, rate=8.0, seed=1)
        config = {"num_replicas": 1}
        run_id = baseline.run_workload(
            workload, name="serve-auto", config=config, batching_policy="continuous", vocab_size=1000
        )
    finally:
        baseline.shutdown()
        ray.kill(store_actor)
    store = MetricsStore(path)
    traces = store.traces(run_id)
    assert len(traces) == 48 and all(t.finish_reason == "length" for t in traces)
    assert sorted(t.num_output_tokens for t in traces) == sorted(workload.output_lens)
    rows = store.scaling(run_id)
    assert rows and {r["policy"] for r in rows} == {SERVE_AUTOSCALER}
    assert any(r["desired"] > r["current"] for r in rows)  # Serve started a replica
    timeline = replica_timeline(store, run_id)
    span = timeline.end - timeline.start
    assert timeline.peak == 2 and span < timeline.replica_seconds <= 2 * span
