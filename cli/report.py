"""`slotserve report`: analyse stored runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from metrics.definitions import SLO
from metrics.goodput_report import analyze, format_report, resolve_run, to_csv
from metrics.store import DEFAULT_STORE, MetricsStore, StoreError


def print_reports(store_path: Path, refs: list[str], slo: SLO, fmt: str = "table") -> None:
    """Print the analyses of the runs `refs` (ids or 'latest') as a table, CSV or JSON."""
    if not Path(store_path).is_file():
        raise StoreError(
            f"no metrics store at {store_path} (runs write to {DEFAULT_STORE} by default; pass --store PATH)"
        )
    store = MetricsStore(store_path)
    analyses = [analyze(store, resolve_run(store, ref), slo) for ref in refs]
    if fmt == "json":
        print(json.dumps(analyses, indent=2))
    elif fmt == "csv":
        sys.stdout.write(to_csv(analyses))
    else:
        print(format_report(analyses))


def run(args: argparse.Namespace) -> int:
    fmt = "json" if args.json else "csv" if args.csv else "table"
    print_reports(args.store, args.runs, SLO(args.slo_ttft, args.slo_tpot, args.slo_e2e), fmt)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `slotserve report` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "report",
        help="goodput, latency, occupancy and balance of stored runs",
        description="Analyse runs in the metrics store, for the cluster and for each replica: throughput, goodput "
        "and SLO attainment, TTFT/TPOT/ITL/E2E percentiles (p50, p90, p99, max), occupancy, slot "
        "efficiency, preemptions, rejected and failed requests, and the imbalance across replicas.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run id, or 'latest' for the most recently begun run")
    p.add_argument("--store", type=Path, default=DEFAULT_STORE, metavar="PATH", help="metrics store file")
    p.add_argument("--slo-ttft", type=float, default=SLO.ttft, metavar="S", help="TTFT limit in seconds")
    p.add_argument("--slo-tpot", type=float, default=SLO.tpot, metavar="S", help="TPOT limit in seconds")
    p.add_argument(
        "--slo-e2e",
        type=float,
        default=SLO.e2e,
        metavar="S",
        help="end-to-end latency limit in seconds (default: no limit)",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="one CSV row per run and scope instead of the table")
    fmt.add_argument("--json", action="store_true", help="the full analyses as JSON instead of the table")
    p.set_defaults(func=run)
