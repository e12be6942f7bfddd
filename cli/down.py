"""`slotserve down`: stop the slotserve actors."""

from __future__ import annotations

import argparse

from cli import common


def run(args: argparse.Namespace) -> int:
    from cluster.client import connect
    from cluster.deploy import stop_cluster

    connect(args.address)
    names = stop_cluster()
    print(f"stopped {len(names)} actors" if names else "no slotserve cluster was running")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    d = subparsers.add_parser(
        "down", help="stop the slotserve actors", description="Stop the router, replicas and store."
    )
    common.address_arg(d)
    d.set_defaults(func=run)
