"""`slotserve experiment FILE`: run an experiment file and write its report."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import ray

from cli.help import RawDescriptionDefaultsHelpFormatter
from experiments.experiment_report import against_serve, format_summary, prefix_ceilings, summarize_runs, write_report
from experiments.plan import Plan, plan_experiment
from experiments.pools_report import against_colocated
from experiments.run import ExperimentResult, collect_experiment, run_experiment
from experiments.scaling_report import against_static
from metrics.store import DEFAULT_STORE
from replica.errors import ConfigError
from workloads.experiment import ExperimentError


def _command(args: argparse.Namespace) -> str:
    """The command line that made a report, as a user would type it."""
    words = ["slotserve", "experiment", str(args.file)]
    words += ["--simulate"] * args.simulate
    words += ["--from-store"] * args.from_store
    for flag, value in (("--store", args.store), ("--out", args.out), ("--address", args.address)):
        if value is not None and not (flag == "--store" and value == DEFAULT_STORE):
            words += [flag, str(value)]
    for flag, values in (("--seeds", args.seeds), ("--loads", args.loads)):
        if values:
            words += [flag, *map(str, values)]
    words += ["--allow-outside-paths"] * args.allow_outside_paths
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_experiment(args.file, args.seeds, args.simulate, args.allow_outside_paths, args.loads)
        if plan.skipped:
            print(
                f"{args.file}: {plan.skipped} cells routed by Ray Serve's routers left out: they run on a Ray cluster"
            )
        if plan.serve_unscalable:
            print(
                f"{args.file}: {plan.serve_unscalable} cells routed by Ray Serve's routers left out: "
                "Serve's autoscaler has one rule, target_ongoing"
            )
    except ExperimentError as err:
        raise ConfigError(str(err)) from None
    experiment = plan.experiment
    if args.dry_run:
        print(
            f"{args.file}: {experiment.name}: {len(plan.cells)} cells "
            f"({len({c.row for c in plan.cells})} rows x {len(experiment.sweep.seeds)} seeds)"
        )
        for cell in plan.cells:
            print(f"  {cell.label}")
        return 0
    if args.from_store:
        result = _collected(args, plan)
    else:
        try:
            result = run_experiment(plan, simulate=args.simulate, store_path=args.store, address=args.address)
        except KeyboardInterrupt:
            print(
                "slotserve: experiment interrupted; the run in progress is marked 'aborted' in the store",
                file=sys.stderr,
            )
            return 130
        finally:
            if not args.simulate and ray.is_initialized():
                ray.shutdown()
    rows = summarize_runs(result)
    print(format_summary(rows))
    comparisons = against_serve(rows) + prefix_ceilings(result, rows) + against_static(result, rows)
    for line in comparisons + against_colocated(result, rows):
        print(line)
    out = args.out or experiment.path.parent / experiment.name
    report = write_report(result, rows, out, _command(args))
    print(f"runs {', '.join(str(r) for _, r in result.runs)} in {Path(args.store).resolve()}; report: {report}")
    return 0


def _collected(args: argparse.Namespace, plan: Plan) -> ExperimentResult:
    """--from-store: the runs the store holds for the file's cells; the cells without one are named."""
    kind = "simulated" if args.simulate else "cluster"
    if not Path(args.store).is_file():
        raise ConfigError(f"--from-store: no store at {args.store}")
    result, missing = collect_experiment(plan, simulate=args.simulate, store_path=args.store)
    if not result.runs:
        raise ConfigError(
            f"--from-store: {args.store} holds no complete {kind} run of {args.file}'s cells "
            f"(run names '{plan.experiment.name} <cell>'; --dry-run lists the cells)"
        )
    if missing:
        print(f"{args.file}: {len(missing)} of {len(plan.cells)} cells have no complete {kind} run in {args.store}:")
        for cell in missing:
            print(f"  left out: {cell.label}")
    return result


EXAMPLE = """\
an experiment file (TOML; YAML takes the same keys):
  name = "load-sweep"                   # also the report's folder name
  description = "continuous against chunked prefill as load grows"
  plots = ["throughput", "latency", "cdf", "occupancy", "slot_timeline"]   # the default: all

  [workload]                            # a standard workload and its arguments, or
  standard = "long-prompts"             #   spec = { source = "synthetic", ... } (workloads/spec.py)
  args = { num_requests = 64 }          #   spec = { source = "trace", format = "azure", path = "t.csv" }

  [cluster]
  replicas = 2
  slots = 8                             # per replica (or sweep.slots)
  max_seq_len = 640
  model = "fake"                        # or smollm2-135m, or a local Hugging Face directory
  fake_step_seconds = 0.02              # the fake model's flat step, or instead
  # cost_model = "cost_model.json"      each step priced by its work (`slotserve calibrate`): what the fake
  #                                     model and --simulate pay per step
  # cost_scale = 0.25                   the cost model's step times x this
  # engine = { max_wait = 0.2 }         any other EngineConfig field

  [sweep]                               # cells = the product of the axes
  batching = ["continuous", "chunked"]
  routing = ["least_loaded"]            # also Ray Serve's own routers: serve_power_of_two, serve_prefix_cache
  load = [0.5, 1.0, 1.5]                # x measured capacity; leave out for all-at-once or closed loop
  token_budget = [64, 256]              # only for policies that read it (chunked)
  seeds = [0, 1, 2]

  [slo]
  ttft = 2.0                            # seconds
  tpot = 0.25                           # seconds per output token; predicted_latency routes within it
  # e2e = 10.0

Paths in the file are relative to its folder.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `slotserve experiment` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "experiment",
        help="run an experiment file (a sweep of policies and loads) and report it",
        formatter_class=RawDescriptionDefaultsHelpFormatter,
        epilog=EXAMPLE,
        description="Run every cell of an experiment file (TOML or YAML: a workload, the cluster, the axes to\n"
        "sweep, the SLO, the plots) on a Ray cluster started for it, or with --simulate in the\n"
        "simulator, recording one run per cell in the store. Prints a table (median over seeds with\n"
        "the spread) and writes report.md and its plots to <folder of FILE>/<name>/. The whole file\n"
        "is checked before anything runs; an error names the file and line.",
    )
    p.add_argument("file", type=Path, metavar="FILE", help="experiment file (.toml, .yaml or .yml)")
    p.add_argument(
        "--simulate",
        action="store_true",
        help="run the cells in the simulator (cost model: cluster.cost_model, or the fake model's flat "
        "step); runs are marked simulated",
    )
    p.add_argument("--store", type=Path, default=DEFAULT_STORE, metavar="PATH", help="metrics store file")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder for report.md and the plots (default: <folder of FILE>/<name>)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster HOST:PORT (default: the one `ray start` made on this machine, else a local one)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, metavar="SEED", help="replace the file's sweep.seeds")
    p.add_argument(
        "--loads",
        type=float,
        nargs="+",
        default=None,
        metavar="LOAD",
        help="replace the file's sweep.load (multiples of the measured capacity), e.g. to rerun one load",
    )
    p.add_argument("--dry-run", action="store_true", help="check the file and list its cells; run nothing")
    p.add_argument(
        "--from-store",
        action="store_true",
        help="run nothing: report the file's cells from their latest complete runs in --store (simulated "
        "ones with --simulate), e.g. cells run in pieces; cells without a run are named and left out",
    )
    p.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="let the file name a trace or cost model outside its own folder (absolute paths, ..)",
    )
    p.set_defaults(func=run)
