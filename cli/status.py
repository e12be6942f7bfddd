"""`slotserve status`: the replicas, their load, and the routing policy."""

from __future__ import annotations

import argparse

from cli import common


def run(args: argparse.Namespace) -> int:
    from cluster.client import connect
    from cluster.deploy import cluster_status

    connect(args.address)
    status = cluster_status()
    print(f"router policy: {status['router']['policy']}")
    print(f"{'replica':<12}{'node':<14}{'batching':<12}{'slots':>6}{'queue':>7}{'running':>8}{'free':>6}")
    for r in status["replicas"]:
        load = r["load"]
        print(
            f"{r['replica_id']:<12}{r['node_id'][:12]:<14}{r['policy']:<12}{r['num_slots']:>6}"
            f"{load.queue_depth:>7}{load.running:>8}{load.free_slots:>6}"
        )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    st = subparsers.add_parser("status", help="replicas, their load, and the router policy")
    common.address_arg(st)
    st.set_defaults(func=run)
