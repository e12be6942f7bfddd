"""`slotserve up`: start the store, the replicas and the router on a Ray cluster."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import common


def run(args: argparse.Namespace) -> int:
    from cluster.deploy import ensure_ray, start_cluster

    spec = common.cluster_spec(args)
    ensure_ray(args.address, start_local=True)
    model = spec.replica.engine.model if spec.replica.fake_step_seconds is None else "fake flat-cost model"
    print(
        f"starting {spec.num_replicas} replicas ({model}, "
        f"{spec.replica.engine.policy} batching) and the router ({spec.routing_policy}) ...",
        flush=True,
    )
    start_cluster(spec, detached=True)
    print(f"slotserve is up; metrics store: {Path(spec.store_path).resolve()}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    u = subparsers.add_parser(
        "up",
        help="start a router and N replicas on a Ray cluster",
        description="Start the metrics store, N replica actors and the router on the Ray cluster at "
        "--address, or on this machine (starting `ray start --head` if none runs). "
        "They keep running until `slotserve down`.",
    )
    common.address_arg(u)
    common.cluster_args(u)
    u.set_defaults(func=run)
