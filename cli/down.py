"""`slotserve down`: stop the slotserve actors, draining the replicas first."""

from __future__ import annotations

import argparse

from cli import common


def run(args: argparse.Namespace) -> int:
    from cluster.client import connect
    from cluster.deploy import stop_cluster

    connect(args.address)
    if args.drain_timeout > 0:
        print(f"draining: no new requests; running ones get {args.drain_timeout:g} s to finish ...", flush=True)
    names = stop_cluster(drain_timeout=args.drain_timeout)
    print(f"stopped {len(names)} actors" if names else "no slotserve cluster was running")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    d = subparsers.add_parser(
        "down",
        help="stop the slotserve actors",
        description="Stop the router, replicas and store. The replicas first stop admitting requests and "
        "let the ones they hold finish (up to --drain-timeout seconds).",
    )
    common.address_arg(d)
    d.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long running requests get to finish before the replicas stop (0: stop at once)",
    )
    d.set_defaults(func=run)
