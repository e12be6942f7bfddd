"""An experiment file's plan: every cell (a point of the sweep: batching, routing, load,
token budget, slots, seed, workload variant), its engine config and its workload, and the
cost model a simulated run pays. `plan_experiment` checks the whole file before anything
starts; nothing here runs a cell."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from autoscaling.policies import AutoscaleConfig
from cluster.serve_baseline import SERVE_ROUTERS
from protocol.registry import Registry
from replica.config import EngineConfig
from replica.errors import ConfigError
from replica.model.fake import CostModel, FlatCostModel
from replica.scheduling.policies import POLICIES
from router.policies import ROUTING_POLICIES
from sim.cost_model import FittedCostModel
from workloads.capacity import Capacity
from workloads.experiment import Experiment, load_experiment
from workloads.workload import Workload

AXES = (
    "workload",
    "batching",
    "routing",
    "load",
    "token_budget",
    "slots",
)  # a table row's key: a cell without its seed


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


@dataclass
class Plan:
    experiment: Experiment
    cells: list[Cell]
    cost: CostModel | None = None  # what a simulated or fake step costs; None for a real model on Ray
    workload_args: dict[str, dict] = field(default_factory=lambda: {"": {}})  # Cell.workload -> its arguments
    skipped: int = 0  # cells routed by Ray Serve's routers, left out of a simulated plan
    autoscale: AutoscaleConfig | None = None  # [cluster] autoscale, checked; None: a fixed replica count

    def engine_config(self, cell: Cell) -> EngineConfig:
        c = self.experiment.cluster
        model = {} if c.model == "fake" else {"model": c.model}
        return EngineConfig(
            **c.engine,
            **model,
            policy=cell.batching,
            num_slots=cell.slots,
            max_seq_len=c.max_seq_len,
            token_budget=cell.token_budget or c.token_budget,
            dtype=c.dtype,
            device="cuda" if c.num_gpus else c.device,
        )

    def workload(self, cell: Cell, capacity: Capacity) -> Workload:
        """The cell's workload: its seed, at its load x `capacity` (`workloads.capacity`)."""
        spec = self.experiment.workload_spec(cell.seed, self.workload_args[cell.workload])
        if cell.load is None:
            return spec.build()
        workload = spec.at_load(cell.load, capacity).build()
        workload.params.update({"load": cell.load, **capacity.as_params()})
        return workload


# What sweep.routing may name: slotserve's policies and Ray Serve's own routers (`cluster.serve_baseline`).
ROUTERS = Registry("routing policy", {**ROUTING_POLICIES, **SERVE_ROUTERS})

_SET_ELSEWHERE = {"model", "policy", "num_slots", "max_seq_len", "token_budget", "dtype", "device"}


def plan_experiment(
    path: str | Path,
    seeds: list[int] | None = None,
    simulate: bool = False,
    allow_outside_paths: bool = False,
    loads: list[float] | None = None,
) -> Plan:
    """Everything a run needs, checked: the file, every seed's workload, every cell's engine
    config, and (simulating) the cost model. `seeds` and `loads` replace the file's sweep.seeds
    and sweep.load; paths in the file must stay in its folder unless `allow_outside_paths`. Raises ExperimentError
    (file:line: key: what is wrong) before anything has started."""
    experiment = load_experiment(
        path, batching=POLICIES, routing=ROUTERS, seeds=seeds, loads=loads, allow_outside_paths=allow_outside_paths
    )
    sweep, c = experiment.sweep, experiment.cluster
    clash = sorted(_SET_ELSEWHERE & set(c.engine))
    if clash:
        raise experiment.error(("cluster", "engine", clash[0]), "set it in [cluster] or [sweep], not in cluster.engine")
    variants = {" ".join(f"{k}={v}" for k, v in args.items()): args for args in experiment.workload_variants()}
    cells = []
    for name, slots, batching in itertools.product(variants, sweep.slots or [c.slots], sweep.batching):
        budgets = (sweep.token_budget or [c.token_budget]) if POLICIES[batching].reads_token_budget else [None]
        for budget, routing, load, seed in itertools.product(budgets, sweep.routing, sweep.load or [None], sweep.seeds):
            cells.append(Cell(batching, routing, load, budget, slots, seed, name))
    plan = Plan(experiment, cells, workload_args=variants, autoscale=_autoscale(experiment))
    for cell in {cell.deployment: cell for cell in cells}.values():
        try:
            plan.engine_config(cell)
        except ValidationError as err:
            raise experiment.invalid(err, ("cluster", "engine")) from None
    if simulate:  # Ray Serve's routers run only on Ray Serve: the simulator has none of them
        plan.cells = [cell for cell in cells if cell.routing not in SERVE_ROUTERS]
        plan.skipped = len(cells) - len(plan.cells)
        if not plan.cells:
            raise experiment.error(
                ("sweep", "routing"), "only Ray Serve's routers: they run on a Ray cluster, not --simulate"
            )
    if c.cost_scales is not None and not simulate and any(cell.routing in SERVE_ROUTERS for cell in cells):
        raise experiment.error(
            ("cluster", "cost_scales"),
            "Ray Serve's routers serve one deployment of identical replicas: cost_scales cannot run them",
        )
    if simulate or c.model == "fake":
        plan.cost = _cost_model(experiment)
    return plan


def _autoscale(experiment: Experiment) -> AutoscaleConfig | None:
    """`[cluster] autoscale = { policy = ..., min = ..., max = ..., ... }` as an AutoscaleConfig:
    `min` and `max` are the bounds, `cooldown`, `period` and `drain_timeout` in seconds, every
    other key one of the policy's own parameters."""
    given = experiment.cluster.autoscale
    if given is None:
        return None
    names = {"min": "min_replicas", "max": "max_replicas", "cooldown": "cooldown_s", "period": "period_s"}
    names["drain_timeout"] = "drain_timeout_s"
    fields = {names.get(k, k): v for k, v in given.items() if names.get(k, k) in AutoscaleConfig.model_fields}
    params = {k: v for k, v in given.items() if names.get(k, k) not in AutoscaleConfig.model_fields}
    try:
        return AutoscaleConfig(**fields, params=params)
    except ValidationError as err:
        raise experiment.invalid(err, ("cluster", "autoscale")) from None


def _cost_model(experiment: Experiment) -> CostModel:
    c = experiment.cluster
    if c.cost_model is not None:
        try:
            return FittedCostModel.load(experiment.resolve(c.cost_model, ("cluster", "cost_model"))).scaled(
                c.cost_scale
            )
        except ConfigError as err:
            raise experiment.error(("cluster", "cost_model"), str(err)) from None
    if c.model == "fake":
        return FlatCostModel(c.fake_step_seconds)
    raise experiment.error(
        ("cluster", "model"),
        f"--simulate with model {c.model!r} needs cluster.cost_model "
        '(a JSON that `slotserve calibrate` writes), or model = "fake"',
    )
