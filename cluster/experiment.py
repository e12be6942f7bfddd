"""Experiments: measure the cluster's capacity and replay workloads through it, each run
recorded in the store.

`measure_capacity` and `routing_experiment` serve `slotserve run`. `slotserve experiment FILE`
runs an experiment file (`workloads.experiment`): `plan_experiment` checks the whole file and
every cell's workload and engine before anything starts; `run_experiment` runs the cells on a
Ray cluster it starts (replicas restarted only when batching policy, slots or token budget
change; routing switched through the router) or, with `simulate`, in the simulator with the
file's cost model, recording into the same store either way; `cluster.experiment_report`
prints the table and writes the report.

Load is a multiple of capacity measured for the cluster shape: a saturating probe through the
router (real: the median of three; simulated: the same probe on virtual time, which is
deterministic), once per slots-per-replica value, so every batching and routing policy at one
slot count sees exactly the same traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import ray
from pydantic import ValidationError
from tqdm import tqdm

from cluster.client import Client
from cluster.deploy import Deployment
from cluster.driver import run_workload
from cluster.store import DEFAULT_STORE, MetricsStore, open_store
from replica.engine import EngineConfig
from replica.errors import ConfigError
from replica.fake_model import CostModel, FittedCostModel, FlatCostModel
from replica.policies import POLICIES
from replica.scheduler import Scheduler
from router.policies import DEFAULT_POLICY, ROUTING_POLICIES
from workloads.experiment import Experiment, ExperimentError, load_experiment
from workloads.standard import at_load
from workloads.workload import Workload, WorkloadRequest

PROBE_PROMPT_LEN = 32  # tokens per capacity-probe prompt
PROBE_MAX_TOKENS = 24


def decode_rate(token_times: Iterable[list[float]]) -> float:
    """Output tokens/s of a saturating probe: tokens after each request's first, over the
    time from the first first-token to the last token."""
    times = [t for t in token_times if t]
    first = min(t[0] for t in times)
    last = max(t[-1] for t in times)
    return sum(len(t) - 1 for t in times) / (last - first)


async def _probe(client: Client, num_requests: int, max_tokens: int) -> float:
    results = await asyncio.gather(*[
        client.agenerate([100 + i] * PROBE_PROMPT_LEN, max_tokens=max_tokens, ignore_eos=True)
        for i in range(num_requests)])
    return decode_rate(r.token_times for r in results)


def measure_capacity(deployment: Deployment, max_tokens: int = PROBE_MAX_TOKENS, probes: int = 3) -> float:
    """Output tokens/s of the whole cluster with every slot of every replica busy decoding:
    the median of a few saturating probes through the router (not recorded), so one stall
    on a busy machine does not set the load of a whole experiment."""
    infos = ray.get([r.info.remote() for r in deployment.replicas.values()])
    slots = sum(i["num_slots"] for i in infos)
    with Client() as client:
        return statistics.median(asyncio.run(_probe(client, slots, max_tokens)) for _ in range(probes))


def routing_experiment(deployment: Deployment, routing_policies: list[str], workload_name: str, num_requests: int,
                       load: float, seed: int, config: dict, progress: bool = True) -> list[int]:
    """Replay the same seeded workload once per routing policy; returns the run ids."""
    capacity = measure_capacity(deployment)
    workload = at_load(workload_name, num_requests, load, capacity, seed)
    batching = ray.get(next(iter(deployment.replicas.values())).info.remote())["policy"]
    run_ids = []
    for policy in routing_policies:
        ray.get(deployment.router.set_policy.remote(policy))
        stamp = time.strftime("%H%M%S")
        run_ids.append(run_workload(
            deployment, workload, name=f"{workload_name}-{policy}-{stamp}",
            config={**config, "workload": workload.describe(), "workload_params": workload.params},
            batching_policy=batching, routing_policy=policy, seed=seed, progress=progress))
    return run_ids


# --- experiment files: the plan -----------------------------------------------------------

AXES = ("workload", "batching", "routing", "load", "token_budget", "slots")  # a table row's key: a cell without its seed


@dataclass(frozen=True)
class Cell:
    batching: str
    routing: str
    load: float | None  # x measured capacity; None: the workload's own arrivals
    token_budget: int | None  # None: the batching policy has no token budget
    slots: int  # per replica
    seed: int
    workload: str = ""  # one of sweep.workload's argument sets, as "k=v k=v" ("": the workload as given)

    @property
    def deployment(self) -> tuple:
        """What the replicas are started with: a change restarts them."""
        return self.batching, self.slots, self.token_budget

    @property
    def row(self) -> tuple:
        return tuple(getattr(self, a) for a in AXES)

    @property
    def label(self) -> str:
        parts = [self.workload] if self.workload else []
        parts += [f"{self.batching}/{self.routing}"]
        parts += [f"{a}={getattr(self, a)}" for a in ("load", "token_budget") if getattr(self, a) is not None]
        return " ".join(parts + [f"slots={self.slots}", f"seed={self.seed}"])


def uses_token_budget(policy: str) -> bool:
    """Whether a batching policy reads the token budget (overrides the scheduler's hook):
    for the others a token_budget axis would only repeat identical cells."""
    return POLICIES[policy]._token_budget is not Scheduler._token_budget


@dataclass
class Plan:
    experiment: Experiment
    cells: list[Cell]
    cost: CostModel | None = None  # what a simulated step costs; None when not simulating
    workload_args: dict[str, dict] = field(default_factory=lambda: {"": {}})  # Cell.workload -> its arguments

    def engine_config(self, cell: Cell) -> EngineConfig:
        c = self.experiment.cluster
        model = {} if c.model == "fake" else {"model": c.model}
        return EngineConfig(**c.engine, **model, policy=cell.batching, num_slots=cell.slots,
                            max_seq_len=c.max_seq_len, token_budget=cell.token_budget or c.token_budget,
                            dtype=c.dtype, device="cuda" if c.num_gpus else c.device)

    def workload(self, cell: Cell, capacity: float) -> Workload:
        """The cell's workload: its seed, at its load x `capacity` (output tokens/s)."""
        spec = self.experiment.workload_spec(cell.seed, self.workload_args[cell.workload])
        if cell.load is None:
            return spec.build()
        workload = spec.at_load(cell.load, capacity).build()
        workload.params.update({"load": cell.load, "capacity_tokens_per_s": capacity})
        return workload


_SET_ELSEWHERE = {"model", "policy", "num_slots", "max_seq_len", "token_budget", "dtype", "device"}


def plan_experiment(path: str | Path, seeds: list[int] | None = None, simulate: bool = False) -> Plan:
    """Everything a run needs, checked: the file, every seed's workload, every cell's engine
    config, and (simulating) the cost model. `seeds` replaces the file's sweep.seeds. Raises
    ExperimentError (file:line: key: what is wrong) before anything has started."""
    experiment = load_experiment(path, batching=POLICIES, routing=ROUTING_POLICIES, seeds=seeds)
    sweep, c = experiment.sweep, experiment.cluster
    clash = sorted(_SET_ELSEWHERE & set(c.engine))
    if clash:
        raise experiment.error(("cluster", "engine", clash[0]), "set it in [cluster] or [sweep], not in cluster.engine")
    variants = {" ".join(f"{k}={v}" for k, v in args.items()): args for args in experiment.workload_variants()}
    cells = []
    for name, slots, batching in itertools.product(variants, sweep.slots or [c.slots], sweep.batching):
        budgets = (sweep.token_budget or [c.token_budget]) if uses_token_budget(batching) else [None]
        for budget, routing, load, seed in itertools.product(budgets, sweep.routing, sweep.load or [None], sweep.seeds):
            cells.append(Cell(batching, routing, load, budget, slots, seed, name))
    plan = Plan(experiment, cells, workload_args=variants)
    for cell in {cell.deployment: cell for cell in cells}.values():
        try:
            plan.engine_config(cell)
        except ValidationError as err:
            raise experiment.invalid(err, ("cluster", "engine")) from None
    if simulate:
        plan.cost = _cost_model(experiment)
    return plan


def _cost_model(experiment: Experiment) -> CostModel:
    c = experiment.cluster
    if c.cost_model is not None:
        try:
            return FittedCostModel.load(experiment.resolve(c.cost_model))
        except ConfigError as err:
            raise experiment.error(("cluster", "cost_model"), str(err)) from None
    if c.model == "fake":
        return FlatCostModel(c.fake_step_seconds)
    raise experiment.error(("cluster", "model"), f"--simulate with model {c.model!r} needs cluster.cost_model "
                           "(a JSON that `slotserve calibrate` writes), or model = \"fake\"")


# --- running it ---------------------------------------------------------------------------

@dataclass
class ExperimentResult:
    plan: Plan
    simulated: bool
    store_path: Path
    runs: list[tuple[Cell, int]] = field(default_factory=list)  # in the order they ran
    capacities: dict[int, float] = field(default_factory=dict)  # slots per replica -> output tokens/s


class _ExtraConfig:
    """The store as `record_simulation` sees it, with the experiment's fields added to the run
    config it writes (it records only the simulation's own)."""

    def __init__(self, store: MetricsStore, extra: dict):
        self._store, self._extra = store, extra

    def begin_run(self, name: str, config: dict, *args, **kwargs) -> int:
        return self._store.begin_run(name, {**config, **self._extra}, *args, **kwargs)

    def __getattr__(self, attr: str):
        return getattr(self._store, attr)


class _Simulated:
    """Cells in the simulator, recorded by this process (the store's only writer here)."""

    def __init__(self, plan: Plan, store: MetricsStore):
        self.plan, self.store = plan, store

    def _config(self, cell: Cell, routing: str, seed: int):
        from cluster.simulator import SimulationConfig

        return SimulationConfig(num_replicas=self.plan.experiment.cluster.replicas,
                                engine=self.plan.engine_config(cell), routing_policy=routing, seed=seed)

    def capacity(self, cell: Cell) -> float:
        from cluster.simulator import simulate

        config = self._config(cell, DEFAULT_POLICY, 0)
        probe = Workload("capacity-probe", 0, [WorkloadRequest(0.0, PROBE_PROMPT_LEN, PROBE_MAX_TOKENS)]
                         * (config.num_replicas * cell.slots))
        return decode_rate(t.token_times for t in simulate(probe, config, self.plan.cost).traces)

    def run(self, cell: Cell, workload: Workload, name: str, config: dict, slo: dict) -> int:
        from cluster.simulator import record_simulation, simulate

        result = simulate(workload, self._config(cell, cell.routing, cell.seed), self.plan.cost)
        return record_simulation(_ExtraConfig(self.store, config), result, name, slo)

    def close(self) -> None:
        pass


class _OnRay:
    """Cells on a Ray cluster this experiment starts (and stops): the replicas are restarted
    only when the cell's batching policy, slots or token budget differ from the last cell's."""

    def __init__(self, plan: Plan, store_path: Path, address: str | None):
        from cluster.deploy import ensure_ray

        self.plan, self.store_path = plan, store_path
        ensure_ray(address, start_local=False)
        self.deployment: Deployment | None = None
        self.deployed: tuple | None = None

    def _deploy(self, cell: Cell) -> Deployment:
        from cluster.deploy import ClusterSpec, start_cluster
        from replica.serving import ReplicaConfig

        if self.deployed != cell.deployment:
            self.close()
            c = self.plan.experiment.cluster
            spec = ClusterSpec(num_replicas=c.replicas, routing_policy=cell.routing,
                               replica=ReplicaConfig(engine=self.plan.engine_config(cell),
                                                     fake_step_seconds=c.fake_step_seconds),
                               num_cpus_per_replica=c.num_cpus, num_gpus_per_replica=c.num_gpus,
                               store_path=str(self.store_path))
            self.deployment, self.deployed = start_cluster(spec), cell.deployment
        return self.deployment

    def capacity(self, cell: Cell) -> float:
        deployment = self._deploy(cell)
        ray.get(deployment.router.set_policy.remote(DEFAULT_POLICY))
        return measure_capacity(deployment)

    def run(self, cell: Cell, workload: Workload, name: str, config: dict, slo: dict) -> int:
        deployment = self._deploy(cell)
        ray.get(deployment.router.set_policy.remote(cell.routing))
        return run_workload(deployment, workload, name=name, config=config, batching_policy=cell.batching,
                            routing_policy=cell.routing, seed=cell.seed, slo=slo, progress=False)

    def close(self) -> None:
        """Stop the slotserve actors and wait until their names are free for the next start."""
        from cluster.deploy import stop_cluster

        if self.deployment is None:
            return
        names = set(stop_cluster())
        self.deployment = self.deployed = None
        deadline = time.monotonic() + 60
        while names & {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}:
            if time.monotonic() > deadline:
                raise ConfigError(f"slotserve actors did not stop within 60 s: {sorted(names)}")
            time.sleep(0.2)


def run_experiment(plan: Plan, *, simulate: bool, store_path: str | Path = DEFAULT_STORE, address: str | None = None,
                   progress: bool = True) -> ExperimentResult:
    """Run every cell of `plan` (made by `plan_experiment(..., simulate=simulate)`), one run
    in the store each. A cell cut short (Ctrl-C, an error) leaves its run ended 'aborted' or
    'failed', never 'running' or 'complete', and the error goes on up."""
    experiment = plan.experiment
    store_path = Path(store_path)
    store = open_store(store_path)
    result = ExperimentResult(plan, simulate, store_path)
    backend = _Simulated(plan, store) if simulate else _OnRay(plan, store_path, address)
    bar = tqdm(plan.cells, desc=experiment.name, unit="cell", disable=not progress)
    slo = experiment.slo.model_dump()
    since = max((r["run_id"] for r in store.runs()), default=0)  # every run this experiment begins is above
    try:
        for cell in bar:
            bar.set_postfix_str(cell.label)
            if cell.slots not in result.capacities:
                result.capacities[cell.slots] = backend.capacity(cell)
            capacity = result.capacities[cell.slots]
            workload = plan.workload(cell, capacity)
            name = f"{experiment.name} {cell.label}"
            config = {"experiment": experiment.name, "experiment_file": str(experiment.path.resolve()),
                      "cell": asdict(cell), "capacity_tokens_per_s": capacity,
                      "cluster": experiment.cluster.model_dump(), "workload": workload.describe(),
                      "workload_params": workload.params, "workload_spec": workload.spec}
            try:
                run_id = backend.run(cell, workload, name, config, slo)
            except BaseException as err:
                _end_unfinished(store, name, since, "aborted" if isinstance(err, KeyboardInterrupt) else "failed")
                raise
            result.runs.append((cell, run_id))
    finally:
        bar.close()
        backend.close()
        store.close()
    return result


def _end_unfinished(store: MetricsStore, name: str, since: int, status: str) -> None:
    """End the run a cell began (named `name` (unique in the experiment), id above `since`)
    if it is still 'running'."""
    for run in store.runs():
        if run["run_id"] > since and run["name"] == name and run["status"] == "running":
            store.end_run(run["run_id"], status)


# --- command line -------------------------------------------------------------------------

def _command(args: argparse.Namespace) -> str:
    """The command line that made a report, as a user would type it."""
    words = ["slotserve", "experiment", str(args.file)]
    words += ["--simulate"] * args.simulate
    for flag, value in (("--store", args.store), ("--out", args.out), ("--address", args.address)):
        if value is not None and not (flag == "--store" and value == DEFAULT_STORE):
            words += [flag, str(value)]
    if args.seeds:
        words += ["--seeds", *map(str, args.seeds)]
    return shlex.join(words)


def cmd_experiment(args: argparse.Namespace) -> int:
    from cluster.experiment_report import format_table, summarize_runs, write_report

    try:
        plan = plan_experiment(args.file, args.seeds, args.simulate)
    except ExperimentError as err:
        raise ConfigError(str(err)) from None
    experiment = plan.experiment
    if args.dry_run:
        print(f"{args.file}: {experiment.name}: {len(plan.cells)} cells "
              f"({len({c.row for c in plan.cells})} rows x {len(experiment.sweep.seeds)} seeds)")
        for cell in plan.cells:
            print(f"  {cell.label}")
        return 0
    try:
        result = run_experiment(plan, simulate=args.simulate, store_path=args.store, address=args.address)
    except KeyboardInterrupt:
        print("slotserve: experiment interrupted; the run in progress is marked 'aborted' in the store",
              file=sys.stderr)
        return 130
    finally:
        if not args.simulate and ray.is_initialized():
            ray.shutdown()
    rows = summarize_runs(result)
    print(format_table(rows))
    out = args.out or experiment.path.parent / experiment.name
    report = write_report(result, rows, out, _command(args))
    print(f"runs {', '.join(str(r) for _, r in result.runs)} in {Path(args.store).resolve()}; report: {report}")
    return 0


_EXAMPLE = """\
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
  fake_step_seconds = 0.02              # the fake model's flat step
  # cost_model = "../results/cost_model.json"   what --simulate pays per step (`slotserve calibrate`)
  # engine = { max_wait = 0.2 }         any other EngineConfig field

  [sweep]                               # cells = the product of the axes
  batching = ["continuous", "chunked"]
  routing = ["least_loaded"]
  load = [0.5, 1.0, 1.5]                # x measured capacity; leave out for all-at-once or closed loop
  token_budget = [64, 256]              # only for policies that read it (chunked)
  seeds = [0, 1, 2]

  [slo]
  ttft = 2.0                            # seconds
  tpot = 0.25
  # e2e = 10.0

Paths in the file are relative to its folder.
"""


def add_experiment_command(subparsers: argparse._SubParsersAction) -> None:
    """Register `slotserve experiment` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "experiment", help="run an experiment file (a sweep of policies and loads) and report it",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXAMPLE,
        description="Run every cell of an experiment file (TOML or YAML: a workload, the cluster, the axes to\n"
                    "sweep, the SLO, the plots) on a Ray cluster started for it, or with --simulate in the\n"
                    "simulator, recording one run per cell in the store. Prints a table (median over seeds with\n"
                    "the spread) and writes report.md and PNG plots to <folder of FILE>/<name>/. The whole file\n"
                    "is checked before anything runs; an error names the file and line.")
    p.add_argument("file", type=Path, metavar="FILE", help="experiment file (.toml, .yaml or .yml)")
    p.add_argument("--simulate", action="store_true",
                   help="run the cells in the simulator (cost model: cluster.cost_model, or the fake model's flat "
                        "step); runs are marked simulated")
    p.add_argument("--store", type=Path, default=DEFAULT_STORE, metavar="PATH",
                   help="metrics store file (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="folder for report.md and the plots (default: <folder of FILE>/<name>)")
    p.add_argument("--address", default=None,
                   help="Ray cluster HOST:PORT (default: the one `ray start` made on this machine, else a local one)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, metavar="SEED", help="replace the file's sweep.seeds")
    p.add_argument("--dry-run", action="store_true", help="check the file and list its cells; run nothing")
    p.set_defaults(func=cmd_experiment)
