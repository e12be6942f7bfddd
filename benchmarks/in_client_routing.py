"""Routing inside the client (`Client(routing="local")`, as Ray Serve's handle routes) against
asking the router actor, on one cluster of flat-cost fake replicas.

(a) decisions/s: a routing decision and its completion, one request at a time, through the
client's local `Router` (its sync thread running) and through the router actor (one Ray call
each, and bursts of 16 per `route_many` call as the async client batches them);
(b) the same seeded `bursty-mix` workload at --load x measured capacity replayed through each,
alternating, --repeats times: goodput, TTFT p99 and imbalance (max over mean output tokens per
replica), median and spread (max - min) over the repeats.

    .venv/bin/python benchmarks/in_client_routing.py [--replicas 4] [--requests 200] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import ray

from cluster.client import Client
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from cluster.driver import run_workload
from experiments.backends import measure_capacity
from metrics.definitions import SLO
from metrics.goodput_report import analyze
from metrics.store import MetricsStore
from protocol.routing import RouteRequest
from replica.config import EngineConfig
from replica.serving.loop import ReplicaConfig
from workloads.standard import at_load


def _route(i: int) -> RouteRequest:
    return RouteRequest(f"rate-{uuid.uuid4().hex[:8]}-{i}", 32, 32)


def _local_rate(n: int) -> float:
    with Client(routing="local") as client:
        local = client.local_router
        start = time.perf_counter()
        for i in range(n):
            route = _route(i)
            local.route_many([route])
            local.complete(route.request_id, output_len=32)
        return n / (time.perf_counter() - start)


def _actor_rate(router, n: int, burst: int) -> float:
    start = time.perf_counter()
    for k in range(0, n, burst):
        routes = [_route(k + j) for j in range(burst)]
        ray.get(router.route_many.remote(routes))
        ray.get([router.complete.remote(r.request_id, None, 32) for r in routes])
    return n / (time.perf_counter() - start)


def replay(args: argparse.Namespace, store_path: Path, slo: SLO) -> tuple[dict[str, list[dict]], dict, str]:
    spec = ClusterSpec(
        num_replicas=args.replicas,
        routing_policy=args.policy,
        store_path=str(store_path),
        seed=args.seed,
        replica=ReplicaConfig(engine=EngineConfig(num_slots=args.slots, max_seq_len=512), fake_step_seconds=args.step),
    )
    deployment = start_cluster(spec)
    try:
        rates = {
            "local (in the client)": _local_rate(args.decisions),
            "actor, one per call": _actor_rate(deployment.router, args.decisions // 10, 1),
            "actor, 16 per call": _actor_rate(deployment.router, args.decisions // 4, 16),
        }
        capacity = measure_capacity(deployment)
        workload = at_load("bursty-mix", args.requests, args.load, capacity, args.seed)
        config = {**spec.model_dump(), "workload": workload.describe(), "load": args.load, **capacity.as_params()}
        runs: dict[str, list[dict]] = {"actor": [], "local": []}
        for repeat in range(args.repeats):
            for mode in runs:
                run_id = run_workload(
                    deployment,
                    workload,
                    name=f"in-client-{mode}-{repeat}",
                    config={**config, "client_routing": mode},
                    batching_policy="continuous",
                    routing_policy=args.policy,
                    seed=args.seed,
                    slo=asdict(slo),
                    progress=False,
                    client_routing=mode,
                )
                runs[mode].append(analyze(MetricsStore(store_path), run_id, slo))
        return runs, rates, workload.describe()
    finally:
        stop_cluster()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--step", type=float, default=0.02, help="seconds per step of the flat-cost fake model")
    p.add_argument("--policy", default="least_loaded", help="routing policy, the same on both paths")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decisions", type=int, default=4000, help="decisions timed on the local path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=0.5)
    p.add_argument("--slo-tpot", type=float, default=0.05)
    args = p.parse_args(argv)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    store_path = Path(tempfile.mkdtemp()) / "in_client.db"
    ray.init(
        address="local", num_cpus=args.replicas + 2, namespace="slotserve", include_dashboard=False, log_to_driver=False
    )
    try:
        runs, rates, described = replay(args, store_path, slo)
    finally:
        ray.shutdown()

    print(f"\n{args.replicas} replicas x {args.slots} slots, flat-cost {args.step * 1000:.0f} ms/step, {args.policy}")
    print("(a) decisions/s, route + complete, one request at a time")
    local_rate = rates["local (in the client)"]
    for name, rate in rates.items():
        print(f"  {name:<24}{rate:>10,.0f}   local / this {local_rate / rate:6.1f}x")
    print(f"(b) {described}; SLO TTFT <= {slo.ttft} s, TPOT <= {slo.tpot} s; {args.repeats} repeats, median (spread)")

    def figure(mode: str, key) -> tuple[float, float]:
        values = [key(a) for a in runs[mode]]
        return statistics.median(values), max(values) - min(values)

    figures = {
        "good tok/s": lambda a: a["cluster"]["goodput"],
        "TTFT p99 s": lambda a: a["cluster"]["ttft"]["p99"],
        "imbalance": lambda a: a["imbalance"]["output_tokens"] or 0.0,
    }
    print(f"  {'routing':<8}" + "".join(f"{name:>22}" for name in figures))
    for mode in runs:
        cells = [figure(mode, key) for key in figures.values()]
        print(f"  {mode:<8}" + "".join(f"{m:>14.3f} ({s:5.3f})" for m, s in cells))
    for name, key in figures.items():
        print(f"  local / actor {name:<11} {figure('local', key)[0] / figure('actor', key)[0]:.2f}")


if __name__ == "__main__":
    main()
