"""The reliability table: what a killed replica, a removed node and a flood cost, measured.

    .venv/bin/python benchmarks/reliability.py            # the README's table (about 2 minutes)
    .venv/bin/python benchmarks/reliability.py --quick    # smaller, for a look

Chaos: a `ray.cluster_utils.Cluster` (head + 3 worker nodes of 2 CPUs), 4 fake-model replicas,
streamed requests arriving over several seconds while replicas are killed (`ray.kill`, Ray
restarts them) and one whole worker node is removed. Every request's tokens are checked against
the fake model's undisturbed output (its next token is a function of the sequence), so
duplicate, missing or wrong tokens are counted exactly. The stall a kill adds is the longest
gap between two tokens of a request that was moved, next to the same figure for the requests
that were not (the peer in the same run).

Overload: a local Ray instance, 2 replicas of 8 slots with bounded queues, offered 10x what they
finish per second for a stated time: accepted and refused counts, how fast a refusal comes
back, accepted requests' TTFT, peak queue and memory of replicas and client, and a request
served normally right after.

`tests/test_reliability_chaos.py` runs `chaos_run` with the test's own sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import threading
import time
from dataclasses import dataclass, field

import ray

from cluster.client import Client, Result
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from protocol.errors import OverloadedError
from replica import EngineConfig
from replica.model.fake import ScriptedFakeRunner
from replica.serving.loop import ReplicaConfig

FAKE = ScriptedFakeRunner(None)  # what an undisturbed run of the fake model makes: FAKE.continuation

FAST_FAILURE_DETECTION = {  # a removed node is declared dead in ~1.5 s instead of Ray's default ~15 s
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


@dataclass
class ChaosStats:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    duplicate_tokens: int = 0
    missing_tokens: int = 0
    wrong_outputs: int = 0
    kills: list[str] = field(default_factory=list)
    migrations: int = 0
    moved_requests: int = 0
    stall_moved: list[float] = field(default_factory=list)  # longest token gap of each moved request
    stall_unmoved: list[float] = field(default_factory=list)
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def token_errors(prompt: list[int], n: int, result: Result) -> tuple[int, int, bool]:
    """A result against the fake model's undisturbed continuation of `prompt`: tokens beyond it
    (duplicated), tokens short of it (missing), and whether the tokens both have differ."""
    want, got = FAKE.continuation(prompt, n), result.token_ids
    return max(0, len(got) - len(want)), max(0, len(want) - len(got)), got[: len(want)] != want[: len(got)]


def _check(stats: ChaosStats, prompt: list[int], n: int, result: Result) -> None:
    stats.completed += result.finish_reason == "length"
    stats.failed += result.finish_reason != "length"
    if result.error:
        stats.errors.append(result.error)
    duplicate, missing, wrong = token_errors(prompt, n, result)
    stats.duplicate_tokens += duplicate
    stats.missing_tokens += missing
    stats.wrong_outputs += wrong
    gaps = [b - a for a, b in zip(result.token_times, result.token_times[1:])]
    (stats.stall_moved if result.migrations else stats.stall_unmoved).append(max(gaps, default=0.0))
    stats.migrations += len(result.migrations)
    stats.moved_requests += bool(result.migrations)


def chaos_run(
    num_requests: int = 300,
    duration: float = 8.0,
    kills: tuple[tuple[float, str], ...] = ((1.5, "replica"), (3.5, "node"), (5.5, "replica")),
    num_replicas: int = 4,
    step: float = 0.01,
    max_tokens: tuple[int, int] = (20, 60),
    seed: int = 0,
) -> ChaosStats:
    """Stream `num_requests` arriving evenly over `duration` seconds through a fresh 3-worker
    Cluster while the `kills` happen (at seconds after the first arrival: "replica" kills one
    with ray.kill, Ray restarting it; "node" removes a worker node holding replicas)."""
    from ray.cluster_utils import Cluster

    rng = random.Random(seed)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": FAST_FAILURE_DETECTION})
    stats = ChaosStats(submitted=num_requests)
    try:
        workers = [cluster.add_node(num_cpus=2) for _ in range(3)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="slotserve", log_to_driver=False, logging_level="ERROR")
        replica = ReplicaConfig(engine=EngineConfig(num_slots=8, max_seq_len=256), fake_step_seconds=step)
        deployment = start_cluster(
            ClusterSpec(
                num_replicas=num_replicas, replica=replica, store_path="/tmp/slotserve-chaos.db", health_period=0.5
            )
        )
        requests = [
            ([rng.randrange(1, 1000) for _ in range(rng.randint(2, 12))], rng.randint(*max_tokens))
            for _ in range(num_requests)
        ]

        def kill(kind: str) -> None:
            infos = {}
            for rid, handle in deployment.replicas.items():
                try:
                    infos[rid] = ray.get(handle.info.remote(), timeout=30)
                except ray.exceptions.RayError:  # restarting after an earlier kill
                    pass
            if kind == "node":
                busy = {i.node_id for i in infos.values()}
                node = next(w for w in workers if w.node_id in busy)
                workers.remove(node)
                cluster.remove_node(node)
                stats.kills.append(
                    f"node {node.node_id[:8]} ({sum(i.node_id == node.node_id for i in infos.values())} replicas)"
                )
            else:
                victim = max(infos, key=lambda r: infos[r].load.running)
                ray.kill(deployment.replicas[victim], no_restart=False)
                stats.kills.append(victim)

        async def one(client: Client, i: int, start: float) -> None:
            await asyncio.sleep(max(0.0, start + i * duration / num_requests - time.monotonic()))
            prompt, n = requests[i]
            try:
                result = await client.agenerate(prompt, max_tokens=n, ignore_eos=True)
            except Exception as err:  # noqa: BLE001 - counted as failed with its reason
                stats.failed += 1
                stats.errors.append(f"{type(err).__name__}: {err}")
                return
            _check(stats, prompt, n, result)

        async def run() -> None:
            with Client() as client:
                start = time.monotonic()
                timers = [threading.Timer(t, kill, (kind,)) for t, kind in kills]
                for timer in timers:
                    timer.start()
                await asyncio.wait_for(asyncio.gather(*[one(client, i, start) for i in range(num_requests)]), 600)
                for timer in timers:
                    timer.join()
                stats.seconds = time.monotonic() - start

        asyncio.run(run())
    finally:
        stop_cluster()
        ray.shutdown()
        cluster.shutdown()
    return stats


@dataclass
class OverloadStats:
    offered: int = 0
    seconds: float = 0.0
    capacity_rps: float = 0.0
    accepted: int = 0
    completed_exact: int = 0
    refused: int = 0
    other_errors: int = 0
    refusal_p50: float = 0.0
    refusal_p99: float = 0.0
    retry_after_p50: float = 0.0
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    peak_queue: int = 0
    queue_bound: int = 0
    replica_peak_rss_mb: float = 0.0
    client_peak_rss_mb: float = 0.0
    after_ok: bool = False


def overload_run(
    seconds: float = 20.0, factor: float = 10.0, max_tokens: int = 16, step: float = 0.01
) -> OverloadStats:
    """Offer `factor` x the cluster's measured request rate for `seconds` and record the figures."""
    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    stats = OverloadStats(queue_bound=32)
    try:
        replica = ReplicaConfig(
            engine=EngineConfig(num_slots=8, max_seq_len=256), fake_step_seconds=step, max_queue=stats.queue_bound
        )
        deployment = start_cluster(
            ClusterSpec(
                num_replicas=2, replica=replica, store_path="/tmp/slotserve-overload.db", max_in_flight_per_replica=48
            )
        )
        with Client() as client:

            async def measure() -> float:  # the rate 2 x 8 slots finish, saturated, no overload
                start = time.monotonic()
                await asyncio.gather(
                    *[client.agenerate([i + 1], max_tokens=max_tokens, ignore_eos=True) for i in range(32)]
                )
                return 32 / (time.monotonic() - start)

            stats.capacity_rps = asyncio.run(measure())
            rate = factor * stats.capacity_rps
            refusals, retry_afters, ttfts = [], [], []

            async def one(i: int, start: float) -> None:
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
                t0 = time.monotonic()
                try:
                    result = await client.agenerate([i % 900 + 1, 5], max_tokens=max_tokens, ignore_eos=True)
                except OverloadedError as err:
                    stats.refused += 1
                    refusals.append(time.monotonic() - t0)
                    retry_afters.append(err.retry_after)
                    return
                except Exception:  # noqa: BLE001
                    stats.other_errors += 1
                    return
                stats.accepted += 1
                stats.completed_exact += result.token_ids == FAKE.continuation([i % 900 + 1, 5], max_tokens)
                ttfts.append(result.ttft)

            async def flood() -> None:
                start = time.monotonic()
                stats.offered = int(rate * seconds)
                await asyncio.gather(*[one(i, start) for i in range(stats.offered)])
                stats.seconds = time.monotonic() - start

            asyncio.run(flood())
            stats.refusal_p50, stats.refusal_p99 = percentile(refusals, 50), percentile(refusals, 99)
            stats.retry_after_p50 = percentile(retry_afters, 50)
            stats.ttft_p50, stats.ttft_p99 = percentile(ttfts, 50), percentile(ttfts, 99)
            infos = [ray.get(h.info.remote()) for h in deployment.replicas.values()]
            stats.peak_queue = max(i.peak_queued for i in infos)
            stats.replica_peak_rss_mb = max(i.peak_rss_mb for i in infos)
            stats.client_peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            stats.after_ok = client.generate([1, 2, 3], max_tokens=8, ignore_eos=True).token_ids == FAKE.continuation(
                [1, 2, 3], 8
            )
    finally:
        stop_cluster()
        ray.shutdown()
    return stats


def print_tables(chaos: ChaosStats, over: OverloadStats) -> None:
    moved_p50, moved_p99 = percentile(chaos.stall_moved, 50), percentile(chaos.stall_moved, 99)
    base_p50, base_p99 = percentile(chaos.stall_unmoved, 50), percentile(chaos.stall_unmoved, 99)
    print("\nChaos: 4 fake replicas (8 slots, 10 ms steps) on 3 worker nodes, kills: " + ", ".join(chaos.kills))
    print("| figure | value |\n|---|---:|")
    for name, value in (
        ("requests submitted", chaos.submitted),
        ("completed", chaos.completed),
        ("failed", chaos.failed),
        ("duplicate tokens", chaos.duplicate_tokens),
        ("missing tokens", chaos.missing_tokens),
        ("outputs differing from an undisturbed run", chaos.wrong_outputs),
        ("requests moved / moves", f"{chaos.moved_requests} / {chaos.migrations}"),
        ("stall of moved requests (longest token gap) p50 / p99 (s)", f"{moved_p50:.2f} / {moved_p99:.2f}"),
        ("longest token gap of the other requests p50 / p99 (s)", f"{base_p50:.2f} / {base_p99:.2f}"),
        ("moved / other, p50", f"{moved_p50 / max(base_p50, 1e-9):.0f}x"),
        ("run time (s)", f"{chaos.seconds:.1f}"),
    ):
        print(f"| {name} | {value} |")
    if chaos.errors:
        print("errors:", *sorted(set(chaos.errors))[:5], sep="\n  ")
    print(
        f"\nOverload: 2 fake replicas x 8 slots, queue bound {over.queue_bound} each; capacity "
        f"{over.capacity_rps:.0f} req/s measured, offered {over.offered / max(over.seconds, 1e-9):.0f} req/s "
        f"for {over.seconds:.0f} s"
    )
    print("| figure | value |\n|---|---:|")
    for name, value in (
        ("offered", over.offered),
        ("accepted (all completed exactly)", f"{over.accepted} ({over.completed_exact} exact)"),
        ("refused with OverloadedError", over.refused),
        ("other errors", over.other_errors),
        ("refusal latency p50 / p99 (ms)", f"{over.refusal_p50 * 1000:.1f} / {over.refusal_p99 * 1000:.1f}"),
        ("retry-after hint p50 (s)", f"{over.retry_after_p50:.2f}"),
        ("accepted TTFT p50 / p99 (s)", f"{over.ttft_p50:.2f} / {over.ttft_p99:.2f}"),
        ("peak replica queue / bound", f"{over.peak_queue} / {over.queue_bound}"),
        ("replica peak RSS (MB)", f"{over.replica_peak_rss_mb:.0f}"),
        ("client peak RSS (MB)", f"{over.client_peak_rss_mb:.0f}"),
        ("served normally right after", over.after_ok),
    ):
        print(f"| {name} | {value} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 chaos requests, 5 s of overload")
    args = parser.parse_args()
    chaos = chaos_run(num_requests=100 if args.quick else 300, duration=6.0 if args.quick else 8.0)
    over = overload_run(seconds=5.0 if args.quick else 20.0)
    print_tables(chaos, over)


if __name__ == "__main__":
    main()
