"""Scale-downs under load lose nothing: an autoscaled cluster of fake-model replicas is driven
through bursts of long streamed requests, so the controller (`cluster.autoscaler`) grows it to
its maximum on each burst and drains it back as the burst thins out, while requests still run
on the replicas it drains (a short drain timeout hands them on, token-exact, to the others).

    .venv/bin/python -m benchmarks.autoscaling_churn --cycles 10   # >= 20 scale-downs (a few minutes)
    .venv/bin/python -m benchmarks.autoscaling_churn --cycles 1    # one burst, for a look

Every request's tokens are checked against the fake model's undisturbed output (its next token
is a function of the sequence), so a lost, duplicated or wrong token is counted exactly. The
figure: scale-downs, drains that had requests to hand on, requests moved, and lost, duplicated
and wrong tokens (all three must be 0), with the replicas' measured cold starts.

`tests/test_autoscaling_cluster.py` runs `churn_run` with one burst.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from autoscaling.policies import AutoscaleConfig
from benchmarks.reliability import token_errors
from cluster.autoscaler import autoscaler_status
from cluster.client import Client, Result
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from protocol.scaling import AutoscalerStatus
from replica import EngineConfig
from replica.serving.loop import ReplicaConfig


@dataclass(frozen=True)
class Phase:
    seconds: float
    every: float  # seconds between two arrivals


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the first
    prompt: list[int]
    max_tokens: int


@dataclass
class ChurnStats:
    requests: int = 0
    completed: int = 0
    lost_tokens: int = 0
    duplicated_tokens: int = 0
    wrong_outputs: int = 0
    moved_requests: int = 0
    drains_with_moves: int = 0  # distinct drained replicas that handed requests on
    peak_serving: int = 0
    seconds: float = 0.0
    status: AutoscalerStatus | None = None  # the controller's, at the end
    scaling_rows: int = 0  # decisions the store recorded for the run
    errors: list[str] = field(default_factory=list)

    @property
    def scale_downs(self) -> int:
        return self.status.scale_downs if self.status else 0


def autoscale_config(max_replicas: int, slots: int) -> AutoscaleConfig:
    """Ray Serve's rule on a short clock: aim at one replica per `slots` - 1 ongoing requests (so
    a busy phase's replicas keep up, with no backlog stuck on one), up at once, down after half
    a second, drained requests moved after 0.2 s."""
    return AutoscaleConfig(
        policy="target_ongoing",
        min_replicas=1,
        max_replicas=max_replicas,
        cooldown_s=0.5,
        period_s=0.25,
        drain_timeout_s=0.2,
        params={
            "target_ongoing_requests": slots - 1,
            "upscale_delay_s": 0.0,
            "downscale_delay_s": 0.5,
            "look_back_s": 0.5,
        },
    )


def _check(stats: ChurnStats, prompt: list[int], n: int, result: Result) -> None:
    stats.completed += result.finish_reason == "length"
    if result.error:
        stats.errors.append(result.error)
    duplicated, lost, wrong = token_errors(prompt, n, result)
    stats.duplicated_tokens += duplicated
    stats.lost_tokens += lost
    stats.wrong_outputs += wrong
    stats.moved_requests += bool(result.migrations)


def _serving(status: AutoscalerStatus | None) -> int:
    return sum(r.state == "serving" for r in status.replicas) if status else 0


async def _arrive(client: Client, prompt: list[int], n: int, delay: float) -> Result:
    await asyncio.sleep(delay)
    return await client.agenerate(prompt, max_tokens=n, ignore_eos=True)


def schedule(cycles: int, phases: tuple[Phase, ...], tokens: tuple[int, int], seed: int) -> list[Arrival]:
    """Every request: `cycles` times the `phases` one after another (busy, then quiet), each a
    steady stream of arrivals. A busy phase grows the cluster and spreads its requests over
    every replica; when the quiet one begins, replicas are drained while each still runs some."""
    rng = random.Random(seed)
    plan, start, k = [], 0.0, 0
    for _ in range(cycles):
        for phase in phases:
            for i in range(int(phase.seconds / phase.every)):
                plan.append(Arrival(start + i * phase.every, [k % 990 + 3, k // 990 + 1], rng.randint(*tokens)))
                k += 1
            start += phase.seconds
    return plan


async def _replay(stats: ChurnStats, plan: list[Arrival]) -> list[Result]:
    with Client() as client:
        task = asyncio.gather(*[_arrive(client, a.prompt, a.max_tokens, a.at) for a in plan])
        while not task.done():  # watch the cluster grow and shrink meanwhile
            stats.peak_serving = max(stats.peak_serving, _serving(await asyncio.to_thread(autoscaler_status)))
            await asyncio.wait([task], timeout=0.5)
    for arrival, result in zip(plan, task.result()):
        _check(stats, arrival.prompt, arrival.max_tokens, result)
    stats.requests = len(plan)
    return task.result()


def churn_run(
    cycles: int = 10,
    max_replicas: int = 3,
    slots: int = 4,
    step: float = 0.02,
    phases: tuple[Phase, ...] = (Phase(16.0, 0.2), Phase(10.0, 0.6)),
    tokens: tuple[int, int] = (40, 120),
    seed: int = 0,
    settle_timeout: float = 120.0,
) -> ChurnStats:
    """The `schedule` of `cycles` busy and quiet phases (outputs of `tokens` lengths, so requests
    end apart) through an autoscaled cluster on this process's Ray, started and stopped here; after the last one,
    waits (up to `settle_timeout`) for the cluster to drain back to one replica."""
    stats = ChurnStats()
    store = Path(tempfile.mkdtemp(prefix="slotserve-churn-")) / "churn.db"
    replica = ReplicaConfig(engine=EngineConfig(num_slots=slots, max_seq_len=512), fake_step_seconds=step)
    spec = ClusterSpec(
        num_replicas=1,
        replica=replica,
        store_path=str(store),
        health_period=0.25,
        autoscale=autoscale_config(max_replicas, slots),
    )
    deployment = start_cluster(spec)
    try:
        run_id = ray.get(deployment.store.begin_run.remote("autoscaling-churn", {}, "continuous", "least_loaded", seed))
        ray.get(deployment.router.set_run.remote(run_id))
        started = time.monotonic()
        plan = schedule(cycles, phases, tokens, seed)
        results = asyncio.run(_replay(stats, plan))
        deadline = time.monotonic() + settle_timeout
        while True:  # idle: back to min_replicas, nothing draining
            status = autoscaler_status()
            if len(status.replicas) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        stats.seconds = time.monotonic() - started
        stats.status = status
        stats.drains_with_moves = len({m.from_replica for r in results for m in r.migrations})
        ray.get(deployment.router.set_run.remote(None))
        time.sleep(2 * spec.autoscale.period_s)  # the controller's last writes under the run
        stats.scaling_rows = len(ray.get(deployment.store.scaling.remote(run_id)))
    finally:
        stop_cluster()
    return stats


def report(stats: ChurnStats) -> str:
    status = stats.status
    colds = status.cold_starts if status else []

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} s" if values else "-"

    lines = [
        f"{stats.requests} requests in {stats.seconds:.0f} s: {stats.completed} completed, "
        f"lost tokens {stats.lost_tokens}, duplicated tokens {stats.duplicated_tokens}, "
        f"wrong outputs {stats.wrong_outputs}",
        f"scale-ups {status.scale_ups if status else 0}, scale-downs {stats.scale_downs} "
        f"({stats.drains_with_moves} drains handed requests on; drained replicas finished "
        f"{status.drained_finished if status else 0} requests and moved {stats.moved_requests}), "
        f"peak serving {stats.peak_serving}, decisions recorded {stats.scaling_rows}",
        f"cold starts ({len(colds)}): actor answered {median([c.loaded_s for c in colds])}, "
        f"first step {median([c.first_step_s for c in colds])}, taking traffic {median([c.ready_s for c in colds])} "
        "(medians, from the request)",
    ]
    if status and status.errors:
        lines.append("controller errors: " + "; ".join(status.errors[-3:]))
    if stats.errors:
        lines.append("request errors: " + "; ".join(stats.errors[:3]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cycles", type=int, default=10, help="busy and quiet phases (each drains about max-replicas - 1 replicas)"
    )
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray instance")
    args = parser.parse_args()
    ray.init(
        address="local", num_cpus=args.num_cpus, namespace="slotserve", include_dashboard=False, log_to_driver=False
    )
    try:
        print(report(churn_run(cycles=args.cycles, max_replicas=args.max_replicas)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
