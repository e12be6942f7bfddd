"""`slotserve status`: the replicas, their health and load, and the routing policy."""

from __future__ import annotations

import argparse

from cli import common


def run(args: argparse.Namespace) -> int:
    from cluster.client import connect
    from cluster.deploy import cluster_status
    from protocol.replicas import Unreachable

    connect(args.address)
    status = cluster_status()
    router = status["router"]
    print(
        f"router policy: {router['policy']}  routed: {router['routed']}  rejected (overloaded): "
        f"{router.get('rejected', 0)}"
    )
    print(f"{'replica':<12}{'node':<14}{'batching':<12}{'slots':>6}{'queue':>7}{'running':>8}{'free':>6}  health")
    down = router.get("down", {})
    for r in status["replicas"]:
        routing = f"; not routed to: {down[r.replica_id]}" if r.replica_id in down else ""
        if isinstance(r, Unreachable):
            print(f"{r.replica_id:<12}{'-':<14}{'-':<12}{'-':>6}{'-':>7}{'-':>8}{'-':>6}  DEAD ({r.reason}){routing}")
            continue
        load, health = r.load, r.health
        state = "ok" if health.healthy else f"UNHEALTHY ({health.reason})"
        if health.draining:
            state += ", draining"
        print(
            f"{r.replica_id:<12}{r.node_id[:12]:<14}{r.policy:<12}{r.num_slots:>6}"
            f"{load.queue_depth:>7}{load.running:>8}{load.free_slots:>6}  {state}"
            f" (last step {health.last_step_age:.1f} s ago){routing}"
        )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    st = subparsers.add_parser("status", help="replicas, their health and load, and the router policy")
    common.address_arg(st)
    st.set_defaults(func=run)
