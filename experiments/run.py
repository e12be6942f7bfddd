"""Run an experiment's plan: every cell once, on the simulator or on a Ray cluster, one run
in the store each (`experiments.experiment_report` turns them into a table and a report), or
collect the runs its cells already have in a store, to report them again."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from experiments.backends import RayBackend, SimulatedBackend
from experiments.plan import Cell, Plan
from metrics.store import DEFAULT_STORE, MetricsStore, open_store
from workloads.capacity import Capacity


@dataclass
class ExperimentResult:
    plan: Plan
    simulated: bool
    store_path: Path
    runs: list[tuple[Cell, int]] = field(default_factory=list)  # in the order they ran
    capacities: dict[int, Capacity] = field(default_factory=dict)  # slots per replica -> measured capacity
    vocab_size: int | None = None  # the replicas' vocabulary (prompts are drawn from it), once capacity is measured
    collected: bool = False  # its runs were found in the store (`collect_experiment`), not run now


def run_experiment(
    plan: Plan,
    *,
    simulate: bool,
    store_path: str | Path = DEFAULT_STORE,
    address: str | None = None,
    progress: bool = True,
) -> ExperimentResult:
    """Run every cell of `plan` (made by `plan_experiment(..., simulate=simulate)`), one run
    in the store each. A cell cut short (Ctrl-C, an error) leaves its run ended 'aborted' or
    'failed', never 'running' or 'complete', and the error goes on up."""
    experiment = plan.experiment
    store_path = Path(store_path)
    store = open_store(store_path)
    result = ExperimentResult(plan, simulate, store_path)
    backend = SimulatedBackend(plan, store) if simulate else RayBackend(plan, store_path, address)
    bar = tqdm(plan.cells, desc=experiment.name, unit="cell", disable=not progress)
    slo = experiment.slo.model_dump()
    since = max((r["run_id"] for r in store.runs()), default=0)  # every run this experiment begins is above
    try:
        for cell in bar:
            bar.set_postfix_str(cell.label)
            if cell.slots not in result.capacities:
                result.capacities[cell.slots] = backend.capacity(cell)
                result.vocab_size = backend.vocab_size
            capacity = result.capacities[cell.slots]
            workload = plan.workload(cell, capacity)
            replicas = plan.num_replicas(cell, workload, capacity)
            name = run_name(plan, cell)
            scaling = plan.scaling(cell)
            config = {
                "experiment": experiment.name,
                "experiment_file": str(experiment.path.resolve()),
                "cell": asdict(cell),
                **capacity.as_params(),
                "vocab_size": result.vocab_size,
                "cluster": experiment.cluster.model_dump(),
                "workload": workload.describe(),
                "workload_params": workload.params,
                "workload_spec": workload.spec,
                "num_replicas": replicas,  # at the start: an autoscaler's changes are in the scaling table
                "scaling": None if scaling is None else {"label": cell.scaling, **scaling.model_dump()},
            }
            try:
                run_id = backend.run(cell, workload, name, config, slo, replicas, capacity)
            except BaseException as err:
                _end_unfinished(store, name, since, "aborted" if isinstance(err, KeyboardInterrupt) else "failed")
                raise
            result.runs.append((cell, run_id))
    finally:
        bar.close()
        backend.close()
        store.close()
    return result


def run_name(plan: Plan, cell: Cell) -> str:
    """A cell's run name in the store: unique in its experiment, and how its run is found again."""
    return f"{plan.experiment.name} {cell.label}"


def collect_experiment(plan: Plan, *, simulate: bool, store_path: str | Path) -> tuple[ExperimentResult, list[Cell]]:
    """The result of `plan`'s cells from the runs a store already holds, each cell's latest
    complete run of its name (simulated, or on a cluster, as `simulate` says): a report written
    again, or one over cells run in pieces (the file cut to some of its rows, one seed at a
    time). Returns the cells that have no such run apart; the report leaves them out."""
    store = MetricsStore(store_path)
    try:
        latest = {r["name"]: r for r in store.runs() if r["status"] == "complete" and bool(r["simulated"]) == simulate}
    finally:
        store.close()
    result, missing = ExperimentResult(plan, simulate, Path(store_path), collected=True), []
    for cell in plan.cells:
        run = latest.get(run_name(plan, cell))
        if run is None:
            missing.append(cell)
            continue
        config = run["config"]
        result.capacities.setdefault(cell.slots, Capacity.from_params(config))
        result.vocab_size = result.vocab_size or config.get("vocab_size")
        result.runs.append((cell, run["run_id"]))
    return result, missing


def _end_unfinished(store: MetricsStore, name: str, since: int, status: str) -> None:
    """End the run a cell began (named `name` (unique in the experiment), id above `since`)
    if it is still 'running'."""
    for run in store.runs():
        if run["run_id"] > since and run["name"] == name and run["status"] == "running":
            store.end_run(run["run_id"], status)
