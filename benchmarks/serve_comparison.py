"""slotserve's routing policies against Ray Serve's own routers, on the same replica engine and
the same seeded workload, recorded in one store.

Starts slotserve with --replicas replicas (flat-cost fake model unless --real), measures the
cluster's capacity, builds the workload at --load x that capacity and replays it once per
slotserve policy; then stops slotserve, deploys the same engine as a Ray Serve deployment
(`cluster.serve_baseline`) and replays the same workload with Serve's default power-of-two
router and its PrefixCacheAffinityRouter. Rounds (--repeats) alternate every arm. Prints per
arm goodput, TTFT p99, SLO attainment and imbalance (median and spread over rounds), then the
best slotserve policy's goodput over Serve's default router's (target: 1.2x at 0.95 load).

    .venv/bin/python benchmarks/serve_comparison.py [--workload heavy-tail] [--requests 200] [--load 0.95]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

import ray

from cluster import serve_baseline
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from cluster.driver import run_workload
from experiments.backends import measure_capacity
from metrics.definitions import SLO
from metrics.report import analyze
from metrics.store import MetricsStore
from replica.config import EngineConfig
from replica.serving import ReplicaConfig
from workloads.standard import at_load

SLOTSERVE_POLICIES = [
    "round_robin",
    "power_of_two",
    "least_loaded",
    "least_work",
    "predicted_length",
    "prefix_affinity",
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--step", type=float, default=0.02, help="seconds per step of the flat-cost fake model")
    p.add_argument("--real", action="store_true", help="serve the default model instead of the fake one")
    p.add_argument("--workload", default="heavy-tail")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--load", type=float, default=0.95)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", default=SLOTSERVE_POLICIES)
    p.add_argument(
        "--prefix-imbalance",
        type=float,
        default=None,
        help="PrefixCacheAffinityRouter's imbalanced_threshold (default: Serve's own, infinite)",
    )
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--store", type=Path, default=None)
    args = p.parse_args(argv)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    store_path = args.store or Path(tempfile.mkdtemp()) / "serve_comparison.db"
    engine = EngineConfig(
        num_slots=args.slots, max_seq_len=1024, policy="chunked", kv_cache="paged", prefix_caching=True
    )
    config = ReplicaConfig(engine=engine, fake_step_seconds=None if args.real else args.step)
    ray.init(
        address="local", num_cpus=args.replicas + 2, namespace="slotserve", include_dashboard=False, log_to_driver=False
    )
    runs: dict[str, list[dict]] = {}
    store = MetricsStore(store_path)
    serve_kwargs = {} if args.prefix_imbalance is None else {"imbalanced_threshold": args.prefix_imbalance}
    try:
        spec = ClusterSpec(num_replicas=args.replicas, replica=config, store_path=str(store_path), seed=args.seed)
        deployment = start_cluster(spec)
        capacity = measure_capacity(deployment)
        workload = at_load(args.workload, args.requests, args.load, capacity, args.seed)
        vocab = ray.get(next(iter(deployment.replicas.values())).info.remote())["vocab_size"]
        base = {"workload": workload.describe(), "load": args.load, **capacity.as_params()}
        base["replica"] = config.model_dump()
        print(f"{workload.describe()}\ncapacity {capacity.as_params()}", flush=True)
        for repeat in range(args.repeats):
            if repeat:
                deployment = start_cluster(spec)
            for policy in args.policies:
                ray.get(deployment.router.set_policy.remote(policy))
                run_id = run_workload(
                    deployment,
                    workload,
                    name=f"cmp-{policy}-{repeat}",
                    config=base,
                    batching_policy=engine.policy,
                    routing_policy=policy,
                    seed=args.seed,
                    slo=asdict(slo),
                    progress=False,
                )
                runs.setdefault(policy, []).append(analyze(store, run_id, slo))
                print(f"  round {repeat} {policy}: run {run_id}", flush=True)
            stop_cluster()
            for router in serve_baseline.SERVE_ROUTERS:
                handle = serve_baseline.deploy(
                    config, args.replicas, router, router_kwargs=serve_kwargs if "prefix" in router else None
                )
                run_id = serve_baseline.run_workload(
                    handle,
                    workload,
                    store,
                    name=f"cmp-{router}-{repeat}",
                    router=router,
                    config={**base, "serve_router_kwargs": serve_kwargs},
                    batching_policy=engine.policy,
                    seed=args.seed,
                    vocab_size=vocab,
                    slo=asdict(slo),
                )
                serve_baseline.shutdown()
                runs.setdefault(router, []).append(analyze(store, run_id, slo))
                print(f"  round {repeat} {router}: run {run_id}", flush=True)
    finally:
        ray.shutdown()

    figures = {
        "good tok/s": lambda a: a["cluster"]["goodput"],
        "TTFT p99 s": lambda a: a["cluster"]["ttft"]["p99"],
        "SLO met %": lambda a: 100 * (a["cluster"]["slo_attainment"] or 0.0),
        "imbalance": lambda a: a["imbalance"]["output_tokens"] or 0.0,
    }

    def median(arm: str, key) -> float:
        return statistics.median(key(a) for a in runs[arm])

    def spread(arm: str, key) -> float:
        values = [key(a) for a in runs[arm]]
        return max(values) - min(values)

    kind = "default model" if args.real else f"flat-cost {args.step * 1000:.0f} ms/step"
    print(
        f"\n{args.replicas} replicas x {args.slots} slots ({kind}), load {args.load:g}; SLO TTFT <= {slo.ttft} s, "
        f"TPOT <= {slo.tpot} s; {args.repeats} round(s): median (spread); store {store_path}"
    )
    print(f"{'routing':<20}" + "".join(f"{name:>20}" for name in figures))
    for arm in runs:
        print(f"{arm:<20}" + "".join(f"{median(arm, k):>12.3f} ({spread(arm, k):5.3f})" for k in figures.values()))
    good = figures["good tok/s"]
    best = max(args.policies, key=lambda arm: median(arm, good))
    serve_default = median("serve_power_of_two", good)
    ratio = median(best, good) / serve_default if serve_default else float("inf")
    verdict = "MET" if ratio >= 1.2 else "MISSED"
    print(f"best slotserve policy {best}: goodput {ratio:.2f}x Ray Serve's default router (target 1.2x: {verdict})")


if __name__ == "__main__":
    main()
