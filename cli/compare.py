"""`slotserve compare`: the batching policies on one in-process replica, same traffic."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cli import common
from protocol import defaults
from replica.scheduling.policies import POLICIES

DEFAULT_OUT = Path("results")


def run(args: argparse.Namespace) -> int:
    from metrics.definitions import SLO
    from sim.batching_comparison import compare_policies, format_comparison

    out_dir = args.out / time.strftime("compare-%Y%m%d-%H%M%S")
    report = compare_policies(
        args.policies,
        args.workload,
        args.requests,
        args.load,
        args.slots,
        args.max_seq_len,
        args.token_budget,
        args.model,
        args.dtype,
        args.seed,
        SLO(args.slo_ttft, args.slo_tpot),
        out_dir,
    )
    print(format_comparison(report))
    print(f"traces, steps, summary and plot: {out_dir}/")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    c = subparsers.add_parser(
        "compare",
        help="compare batching policies on one replica, same traffic",
        description="Replay one seeded workload through each batching policy on one in-process replica "
        "of a real model; print a table and write traces, steps, summary and a plot.",
    )
    c.add_argument(
        "--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES), help="batching policies compared"
    )
    c.add_argument(
        "--workload",
        choices=["long-prompts", "bursty-mix", "saturated"],
        default="long-prompts",
        help="standard workload",
    )
    c.add_argument("--requests", type=int, default=24, help="requests in the workload")
    c.add_argument("--load", type=float, default=0.8, help="arrival rate as a multiple of measured decode capacity")
    c.add_argument("--token-budget", type=int, default=64, help="per-step token budget of the chunked policy")
    common.max_seq_len_arg(c)
    c.add_argument("--seed", type=int, default=0, help="workload seed")
    c.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT limit (s) for goodput")
    c.add_argument("--slo-tpot", type=float, default=defaults.TPOT_SLO, help="TPOT limit (s) for goodput")
    c.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for results")
    common.engine_args(c)
    c.set_defaults(func=run)
