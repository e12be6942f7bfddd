"""Multi-replica scaling with the flat-cost fake model (every step costs the same, so the
ideal cluster of N replicas is exactly N times one replica).

Runs the `saturated` workload (scaled to the cluster's slots) on 1 replica, then on N
replicas, in one process and one Ray instance, and prints each throughput and the ratio.
Target: 4 replicas of 8 slots at 20 ms per step reach at least 3.6x one replica.

    python benchmarks/cluster_scaling.py [--replicas 4] [--slots 8] [--step 0.02] [--waves 4]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import ray

from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from cluster.driver import run_workload
from metrics.definitions import summarize
from metrics.store import MetricsStore
from replica.config import EngineConfig
from replica.serving.loop import ReplicaConfig
from workloads.standard import saturated


def throughput(num_replicas: int, slots: int, step: float, waves: int, store_path: Path) -> tuple[float, float]:
    """Output tokens/s and max submit lateness of a saturated run filling every slot `waves` times."""
    spec = ClusterSpec(
        num_replicas=num_replicas,
        store_path=str(store_path),
        replica=ReplicaConfig(engine=EngineConfig(num_slots=slots, max_seq_len=512), fake_step_seconds=step),
    )
    deployment = start_cluster(spec)
    try:
        workload = saturated(num_requests=num_replicas * slots * waves, seed=0)
        run_id = run_workload(
            deployment,
            workload,
            name=f"scaling-{num_replicas}",
            config=spec.model_dump(),
            batching_policy="continuous",
            routing_policy="least_loaded",
            progress=True,
        )
        store = MetricsStore(store_path)
        summary = summarize(store.traces(run_id))
        lateness = max(r["submit_lateness"] for r in store.requests(run_id))
        return summary.throughput, lateness
    finally:
        stop_cluster()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--step", type=float, default=0.02, help="seconds per step of the fake model")
    parser.add_argument("--waves", type=int, default=4, help="requests per slot")
    args = parser.parse_args(argv)
    ray.init(
        address="local", num_cpus=args.replicas + 2, namespace="slotserve", include_dashboard=False, log_to_driver=False
    )
    store = Path(tempfile.mkdtemp()) / "scaling.db"
    one, late1 = throughput(1, args.slots, args.step, args.waves, store)
    many, late_n = throughput(args.replicas, args.slots, args.step, args.waves, store)
    ray.shutdown()
    ideal = args.slots / args.step
    print(
        f"1 replica : {one:8.1f} output tokens/s ({one / ideal:.0%} of the ideal {ideal:.0f}); "
        f"max submit lateness {late1 * 1000:.1f} ms"
    )
    print(
        f"{args.replicas} replicas: {many:8.1f} output tokens/s ({many / (ideal * args.replicas):.0%} of the ideal "
        f"{ideal * args.replicas:.0f}); max submit lateness {late_n * 1000:.1f} ms"
    )
    print(f"scaling   : {many / one:.2f}x (target >= {0.9 * args.replicas:.1f}x)")
    return {"one": one, "many": many, "ratio": many / one}


if __name__ == "__main__":
    main()
