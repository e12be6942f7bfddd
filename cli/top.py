"""`slotserve top`: a live terminal view of every replica's occupancy, queue, K/V use and
tokens/s, refreshed in place, for users with neither Grafana nor Prometheus.

Occupancy, queue and running requests are the router's live view (each replica's last load
report, and the requests the router has in flight there); K/V use and the token counter come
from each replica's own telemetry (`info()`), tokens/s from the counter's change between frames.
An autoscaled cluster's frame also shows each replica's state and the last scaling decision;
its replicas are looked up again every frame, as they come and go.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from cli import common
from cli.status import autoscaler_lines, replica_states
from protocol.replicas import ReplicaInfo
from protocol.scaling import AutoscalerStatus

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: each frame replaces the last
ALT_SCREEN_ON, ALT_SCREEN_OFF = "\x1b[?1049h", "\x1b[?1049l"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
BAR = 20


@dataclass
class ReplicaLine:
    replica: str
    state: str  # starting, serving or draining
    running: int
    slots: int
    queue: int
    in_flight: int
    kv_used: float | None  # share of the K/V budget reserved
    tokens: int | None  # generated so far (None: the replica exports no telemetry)
    report_age: float | None


def replica_lines(
    status: dict, infos: list[ReplicaInfo], autoscaler: AutoscalerStatus | None = None
) -> list[ReplicaLine]:
    """The router's view of each replica, joined with the replica's own counters and state."""
    by_id = {info.replica_id: info for info in infos}
    states = replica_states(status, autoscaler)
    lines = []
    for replica, view in sorted(status["replicas"].items()):
        report = view["report"] or {}
        snapshot = by_id[replica].telemetry if replica in by_id else {}
        lines.append(
            ReplicaLine(
                replica,
                states.get(replica, "-"),
                report.get("running", 0),
                report.get("num_slots", 0),
                report.get("queue_depth", 0),
                view["in_flight"],
                snapshot.get("kv_cache_usage_perc"),
                snapshot.get("generation_tokens"),
                view["report_age"],
            )
        )
    return lines


def _bar(share: float) -> str:
    filled = round(share * BAR)
    return "[" + "#" * filled + "." * (BAR - filled) + "]"


def frame(
    policy: str,
    lines: list[ReplicaLine],
    rates: dict[str, float],
    interval: float,
    autoscaler: AutoscalerStatus | None = None,
    flow: dict | None = None,
) -> list[str]:
    """One screen: a header (with the autoscaler's lines and, under flow control, the requests
    the router holds per priority band), a line per replica and the totals."""
    head = (
        f"{'replica':<12} {'state':<9} {'occupancy':<{BAR + 7}} {'slots':>7} {'queue':>6} {'in flight':>10} "
        f"{'K/V used':>9} {'tok/s':>8} {'report age':>11}"
    )
    out = [
        f"slotserve top  {time.strftime('%H:%M:%S')}  routing: {policy}  replicas: {len(lines)}  "
        f"(every {interval:g} s; Ctrl-C quits)",
        *autoscaler_lines(autoscaler),
        *flow_lines(flow),
        "",
        head,
        "-" * len(head),
    ]
    for line in lines:
        share = line.running / line.slots if line.slots else 0.0
        kv = "-" if line.kv_used is None else f"{line.kv_used:.0%}"
        rate = f"{rates[line.replica]:.1f}" if line.replica in rates else "-"
        age = "-" if line.report_age is None else f"{line.report_age * 1000:.0f} ms"
        out.append(
            f"{line.replica:<12} {line.state:<9} {_bar(share)} {share:>4.0%} "
            f"{f'{line.running}/{line.slots}':>7} {line.queue:>6} "
            f"{line.in_flight:>10} {kv:>9} {rate:>8} {age:>11}"
        )
    running, slots = sum(x.running for x in lines), sum(x.slots for x in lines)
    share = running / slots if slots else 0.0
    total = f"{sum(rates.values()):.1f}" if rates else "-"
    out.append("-" * len(head))
    out.append(
        f"{'cluster':<12} {'':<9} {_bar(share)} {share:>4.0%} {f'{running}/{slots}':>7} "
        f"{sum(x.queue for x in lines):>6} "
        f"{sum(x.in_flight for x in lines):>10} {'':>9} {total:>8}"
    )
    return out


def flow_lines(flow: dict | None) -> list[str]:
    """The router's flow control (`Router.status()["flow"]`): its policy, and the requests it
    holds per band (lower first) with the refusals so far."""
    if not flow:
        return []
    held = ", ".join(f"{band}: {count}" for band, count in sorted(flow["held"].items())) or "none"
    refused = sum(flow["refused"].values())
    return [f"flow control: {flow['policy']}  held by priority band: {held}  refused: {refused}"]


def run(args: argparse.Namespace) -> int:
    import ray

    from cluster.autoscaler import autoscaler_status
    from cluster.client import connect, router_handle

    connect(args.address)
    router = router_handle()
    live = sys.stdout.isatty()
    if live:
        sys.stdout.write(ALT_SCREEN_ON + HIDE_CURSOR)
    previous: dict[str, tuple[float, int]] = {}
    shown = 0
    try:
        while args.count is None or shown < args.count:
            status = ray.get(router.status.remote(), timeout=30)
            handles = ray.get(router.replicas.remote(), timeout=30)
            infos = _infos(list(handles.values()))
            autoscaler = autoscaler_status()
            now = time.monotonic()
            lines = replica_lines(status, infos, autoscaler)
            rates = {
                x.replica: (x.tokens - previous[x.replica][1]) / (now - previous[x.replica][0])
                for x in lines
                if x.tokens is not None and x.replica in previous
            }
            previous = {x.replica: (now, x.tokens) for x in lines if x.tokens is not None}
            sys.stdout.write(
                (CLEAR if live else "")
                + "\n".join(frame(status["policy"], lines, rates, args.interval, autoscaler, status.get("flow")))
            )
            sys.stdout.write("\n")
            sys.stdout.flush()
            shown += 1
            if args.count is None or shown < args.count:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    finally:
        if live:
            sys.stdout.write(SHOW_CURSOR + ALT_SCREEN_OFF)
            sys.stdout.flush()
    return 0


def _infos(handles: list) -> list[ReplicaInfo]:
    """The replicas' infos; one that is gone (drained, or restarting) is left out of this frame."""
    import ray

    refs = [h.info.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=30)
    infos = []
    for ref in ready:
        try:
            infos.append(ray.get(ref))
        except ray.exceptions.RayError:
            continue
    return infos


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    t = subparsers.add_parser(
        "top",
        help="live per-replica occupancy, queue, K/V use and tokens/s in the terminal",
        description="A live view of the running cluster, refreshed in place: per replica its occupancy "
        "(running / slots, from the router's view), queue, requests in flight, K/V use and output tokens/s.",
    )
    common.address_arg(t)
    t.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    t.add_argument("--count", type=int, default=None, help="stop after this many frames (default: until Ctrl-C)")
    t.set_defaults(func=run)
