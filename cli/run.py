"""`slotserve run`: replay a workload through the cluster once per routing policy (in --repeats
rounds), record it, and close with the comparison's verdict."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli import common, report
from metrics.definitions import SLO
from protocol.cpu import cpu_info


def run(args: argparse.Namespace) -> int:
    import ray

    from cluster.deploy import ensure_ray, find_cluster, start_cluster, stop_cluster
    from experiments.backends import routing_experiment

    if args.repeats < 1:
        raise SystemExit(f"slotserve run: --repeats must be at least 1, got {args.repeats}")
    slo = SLO(args.slo_ttft, args.slo_tpot)
    ensure_ray(args.address, start_local=False)
    owned = not common.running_cluster(args.address)
    spec = common.cluster_spec(args)
    # Figures differ between machines of one kind: the verdict is this machine's.
    print(f"this machine: {cpu_info().describe()}", flush=True)
    if owned:
        print(f"no cluster running: starting {spec.num_replicas} replicas for this run ...", flush=True)
        deployment = start_cluster(spec)
    else:
        deployment = find_cluster()
    try:
        run_ids = routing_experiment(
            deployment,
            args.routing,
            args.workload,
            args.requests,
            args.load,
            args.seed,
            config=spec.model_dump() if owned else {"cluster": "already running"},
            repeats=args.repeats,
            tpot_slo=slo.tpot,
        )
        store_path = Path(ray.get(deployment.store.path.remote(), timeout=60))
    finally:
        if owned:
            stop_cluster()
    ray.shutdown()
    runs = ", ".join(map(str, run_ids))
    if not store_path.exists():  # the cluster's store lives on another machine (its head node)
        print(f"recorded runs {runs} in {store_path} on the Ray cluster's head node (`slotserve report` there)")
        return 0
    if args.report:
        report.print_reports(store_path, list(map(str, run_ids)), slo)
    from metrics.goodput_report import analyze_by_policy
    from metrics.plots import plot_cluster_runs
    from metrics.store import MetricsStore

    store = MetricsStore(store_path)
    by_policy = analyze_by_policy(store, run_ids, slo)
    print_verdict(by_policy, slo)
    plot = plot_cluster_runs(store, by_policy, slo, store_path.parent / f"runs-{run_ids[0]}-{run_ids[-1]}.png")
    print(f"\nrecorded runs {runs} in {store_path}; plot: {plot}")
    return 0


def print_verdict(by_policy: dict[str, list[dict]], slo: SLO) -> None:
    """Each policy's median and spread over its rounds, then the verdict line."""
    from metrics.verdict import verdict_line, verdict_table

    print(f"\nSLO: TTFT <= {slo.ttft} s, TPOT <= {slo.tpot} s; median (spread = max - min) over rounds")
    print(verdict_table(by_policy))
    print(verdict_line(by_policy))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    r = subparsers.add_parser(
        "run",
        help="replay a workload through the cluster and record it",
        description="Measure the cluster's capacity (saturating probes, announced and shown on a progress bar; "
        "not recorded), then replay one seeded workload once per --routing policy, recording every request, "
        "token, step and routing decision in the store, whose path is the last line printed. "
        "Uses the running cluster, or starts one for this run from the options below.",
    )
    common.address_arg(r)
    r.add_argument(
        "--workload",
        choices=["bursty-mix", "long-prompts", "saturated", "heavy-tail", "shared-prefix", "kv-pressure", "zero-reuse"],
        default="bursty-mix",
        help="standard workload replayed",
    )
    r.add_argument("--repeats", type=int, default=1, help="rounds of every --routing policy (for the spread)")
    r.add_argument("--slo-ttft", type=float, default=SLO.ttft, help="TTFT limit (s) of goodput in the report")
    r.add_argument(
        "--slo-tpot",
        type=float,
        default=SLO.tpot,
        help="TPOT limit (s) of goodput in the report, and the one predicted_latency routes within",
    )
    r.add_argument("--requests", type=int, default=32, help="requests in the workload")
    r.add_argument("--load", type=float, default=0.8, help="arrival rate as a multiple of measured cluster capacity")
    r.add_argument("--report", action="store_true", help="print the report of the runs at the end")
    common.cluster_args(r)
    r.set_defaults(func=run)
