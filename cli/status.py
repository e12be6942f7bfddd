"""`slotserve status`: the replicas, their state (starting, serving, draining), health and load,
the routing policy, an autoscaled cluster's policy, bounds and last scaling decision, and a
cluster with prefill and decode pools: each replica's role, the P/D decider and what it decided."""

from __future__ import annotations

import argparse

from cli import common
from protocol.scaling import AutoscalerStatus


def replica_states(router: dict, autoscaler: AutoscalerStatus | None) -> dict[str, str]:
    """Each replica's state: the autoscaler's, or (not autoscaled) the router's: draining if it
    is draining the replica, starting until the replica's first health answer, else serving."""
    if autoscaler is not None:
        return {r.replica_id: r.state for r in autoscaler.replicas}
    draining, starting = set(router.get("draining", [])), set(router.get("starting", []))
    return {
        replica_id: "draining" if replica_id in draining else "starting" if replica_id in starting else "serving"
        for replica_id in router["replicas"]
    }


def autoscaler_lines(autoscaler: AutoscalerStatus | None) -> list[str]:
    """The autoscaling policy, bounds, counts and last decision (nothing when not autoscaled)."""
    if autoscaler is None:
        return []
    lines = [
        f"autoscaling: {autoscaler.policy} [{autoscaler.min_replicas}, {autoscaler.max_replicas}]  "
        f"decisions: {autoscaler.decisions}  up: {autoscaler.scale_ups}  down: {autoscaler.scale_downs}  "
        f"drained requests finished/moved: {autoscaler.drained_finished}/{autoscaler.drained_moved} "
        f"({autoscaler.drained_kv_moved} with their K/V)"
    ]
    last = autoscaler.last_decision
    if last is not None:
        lines.append(f"last decision: {last.current} -> {last.desired} replicas ({last.reason})")
    if autoscaler.cold_starts:
        cold = autoscaler.cold_starts[-1]
        lines.append(
            f"last cold start: {cold.replica_id} answered {cold.loaded_s:.1f} s, first step {cold.first_step_s:.1f} s, "
            f"taking traffic {cold.ready_s:.1f} s after it was asked for"
        )
    lines += [f"autoscaler error: {e}" for e in autoscaler.errors[-3:]]
    return lines


def pools_lines(router: dict) -> list[str]:
    """The P/D decider and how many requests it sent each way (nothing without pools)."""
    if "roles" not in router:
        return []
    roles = router["roles"]
    pools = {role: sorted(r for r in roles if roles[r] == role) for role in ("prefill", "decode")}
    return [
        f"pools: prefill {', '.join(pools['prefill'])}; decode {', '.join(pools['decode'])}  "
        f"decider: {router['pd_decider']}  disaggregated: {router['disaggregated']}  colocated: {router['colocated']}"
    ]


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
    autoscaler = status["autoscaler"]
    for line in autoscaler_lines(autoscaler) + pools_lines(router):
        print(line)
    states = replica_states(router, autoscaler)
    print(
        f"{'replica':<12}{'state':<10}{'node':<14}{'batching':<12}{'slots':>6}{'queue':>7}{'running':>8}"
        f"{'free':>6}  health"
    )
    down = router.get("down", {})
    for replica_id in sorted(states.keys() - {r.replica_id for r in status["replicas"]}):
        print(f"{replica_id:<12}{states[replica_id]:<10}(not yet known to the router)")
    for r in status["replicas"]:
        routing = f"; not routed to: {down[r.replica_id]}" if r.replica_id in down else ""
        role = states.get(r.replica_id, "-")
        if isinstance(r, Unreachable):
            print(
                f"{r.replica_id:<12}{role:<10}{'-':<14}{'-':<12}{'-':>6}{'-':>7}{'-':>8}{'-':>6}"
                f"  DEAD ({r.reason}){routing}"
            )
            continue
        load, health = r.load, r.health
        state = "ok" if health.healthy else f"UNHEALTHY ({health.reason})"
        if health.draining:
            state += ", draining"
        print(
            f"{r.replica_id:<12}{role:<10}{r.node_id[:12]:<14}{r.policy:<12}{r.num_slots:>6}"
            f"{load.queue_depth:>7}{load.running:>8}{load.free_slots:>6}  {state}"
            f" (last step {health.last_step_age:.1f} s ago){routing}"
        )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    st = subparsers.add_parser(
        "status", help="replicas, their state, health and load, the router policy and the last scaling decision"
    )
    common.address_arg(st)
    st.set_defaults(func=run)
