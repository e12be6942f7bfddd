"""An experiment file's plan: every cell (a point of the sweep: batching, routing, load,
token budget, slots, seed, workload variant, how the cluster is sized, its prefill:decode
split), its engine config and its workload, and the cost model a simulated run pays.
`plan_experiment` checks the whole file before anything starts; nothing here runs a cell.

A cell's cluster is `cluster.replicas` replicas, or what its `sweep.autoscale` entry (merged over
`[cluster] autoscale`) says: an autoscaling policy, started at its `min` replicas, or static
provisioning (`StaticSize`), sized from the cell's own workload. A cell routed by one of Ray
Serve's routers is sized by Serve: statically, or by Serve's own autoscaler where its policy is
`target_ongoing` (Serve's rule, `cluster.serve_baseline.serve_autoscaling_config`); paired
with any other policy it cannot run, and is left out (`Plan.serve_unscalable`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, ValidationError

from autoscaling.policies import AutoscaleConfig
from cluster.serve_baseline import SERVE_POLICY, SERVE_ROUTERS
from protocol.flow import FlowConfig
from protocol.registry import Registry, UnknownChoiceError
from replica.config import EngineConfig
from replica.errors import ConfigError
from replica.model.fake import CostModel, FlatCostModel
from replica.scheduling.policies import POLICIES
from router.pd_decider import PD_DECIDERS
from router.policies import ROUTING_POLICIES
from sim.autoscaling import offered_load
from sim.cost_model import FittedCostModel
from sim.disaggregation import KV_LINKS, SimPools
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
    "scaling",
    "pools",
    "flow",
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
    scaling: str = ""  # one of sweep.autoscale's entries, by its label ("": [cluster] replicas or autoscale)
    pools: str = ""  # one of sweep.pools' "P:D" splits ("": [cluster] prefill_replicas and decode_replicas)
    flow: str = ""  # one of sweep.flow's policies ("": the [flow] table's, or no flow control)

    @property
    def deployment(self) -> tuple:
        """What the replicas are started with: a change restarts them."""
        return self.batching, self.slots, self.token_budget, self.scaling, self.pools

    @property
    def row(self) -> tuple:
        return tuple(getattr(self, a) for a in AXES)

    @property
    def label(self) -> str:
        parts = [self.workload] if self.workload else []
        parts += [f"{self.batching}/{self.routing}"] + ([self.scaling] if self.scaling else [])
        parts += [f"pools={self.pools}"] if self.pools else []
        parts += [f"flow={self.flow}"] if self.flow else []
        parts += [f"{a}={getattr(self, a)}" for a in ("load", "token_budget") if getattr(self, a) is not None]
        return " ".join(parts + [f"slots={self.slots}", f"seed={self.seed}"])


class StaticSize(BaseModel):
    """Static provisioning in a `sweep.autoscale` entry: `static` replicas, or as many as keep
    one replica's capacity at `utilization` under the cell's offered load over its busiest
    `window` seconds ("peak") or over its whole span ("mean") (`sim.autoscaling.offered_load`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    static: Literal["peak", "mean"] | PositiveInt
    window: PositiveFloat = Field(10.0, description="seconds of the busiest window a peak is read over")
    utilization: float = Field(0.8, gt=0, le=1, description="offered load per replica a static size aims for")

    def replicas(self, workload: Workload, replica_capacity: Capacity) -> int:
        if isinstance(self.static, int):
            return self.static
        load = offered_load(workload, replica_capacity, self.window if self.static == "peak" else None)
        return max(1, math.ceil(load / self.utilization - 1e-9))


Scaling = AutoscaleConfig | StaticSize | None  # None: cluster.replicas, fixed


@dataclass
class Plan:
    experiment: Experiment
    cells: list[Cell]
    cost: CostModel | None = None  # what a simulated or fake step costs; None for a real model on Ray
    workload_args: dict[str, dict] = field(default_factory=lambda: {"": {}})  # Cell.workload -> its arguments
    skipped: int = 0  # cells routed by Ray Serve's routers, left out of a simulated plan
    serve_unscalable: int = 0  # cells routed by Ray Serve sized by a policy Serve's autoscaler is not
    scalings: dict[str, Scaling] = field(default_factory=lambda: {"": None})  # Cell.scaling -> how it is sized
    cold_start_s: float = 10.0  # a simulated replica's start (actor, model load, first step); Ray measures its own

    @property
    def autoscale(self) -> AutoscaleConfig | None:
        """`[cluster] autoscale` of a file without `sweep.autoscale`, checked."""
        scaling = self.scalings.get("")
        return scaling if isinstance(scaling, AutoscaleConfig) else None

    def scaling(self, cell: Cell) -> Scaling:
        return self.scalings[cell.scaling]

    def replica_capacity(self, capacity: Capacity) -> Capacity:
        """One replica's capacity, from the capacity measured on `cluster.replicas` replicas
        (every slot busy: it grows with the replicas)."""
        n = self.experiment.cluster.replicas
        return Capacity(capacity.decode_tokens_per_s / n, capacity.prefill_tokens_per_s / n)

    def num_replicas(self, cell: Cell, workload: Workload, capacity: Capacity) -> int:
        """The replicas a cell's cluster starts with (`capacity`: measured on `cluster.replicas`)."""
        scaling = self.scaling(cell)
        if isinstance(scaling, AutoscaleConfig):
            return scaling.min_replicas
        if isinstance(scaling, StaticSize):
            return scaling.replicas(workload, self.replica_capacity(capacity))
        return self.experiment.cluster.replicas

    def pools(self, cell: Cell) -> SimPools | None:
        """The cell's prefill and decode pools: its first `prefill_replicas` replicas prefill,
        the rest decode (None: every replica serves whole requests)."""
        c = self.experiment.cluster
        prefill = int(cell.pools.split(":")[0]) if cell.pools else c.prefill_replicas
        if not prefill:
            return None
        link = KV_LINKS[c.kv_link] if isinstance(c.kv_link, str) else c.kv_link
        return SimPools(prefill_replicas=prefill, decider=c.pd_decider, threshold=c.pd_threshold, link=link)

    def flow(self, cell: Cell) -> FlowConfig | None:
        """The cell's flow control: the [flow] table with the cell's policy (None: none, and
        always for Ray Serve's routers, which have none: the peer without flow control)."""
        base = self.experiment.flow
        if not cell.flow:
            return None if cell.routing in SERVE_ROUTERS else base
        return (base or FlowConfig()).model_copy(update={"policy": cell.flow})

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
    scalings, cold_start_s = _scalings(experiment)
    cells = []
    for name, slots, batching in itertools.product(variants, sweep.slots or [c.slots], sweep.batching):
        budgets = (sweep.token_budget or [c.token_budget]) if POLICIES[batching].reads_token_budget else [None]
        for budget, routing, load, scaling, pools, seed in itertools.product(
            budgets, sweep.routing, sweep.load or [None], scalings, sweep.pools or [""], sweep.seeds
        ):
            flows = [""] if routing in SERVE_ROUTERS else sweep.flow or [""]  # Serve has no flow control
            cells += [Cell(batching, routing, load, budget, slots, seed, name, scaling, pools, f) for f in flows]
    runnable = [cell for cell in cells if not _serve_unscalable(cell, scalings)]
    plan = Plan(experiment, runnable, workload_args=variants, scalings=scalings, cold_start_s=cold_start_s)
    plan.serve_unscalable, cells = len(cells) - len(runnable), runnable
    if not cells:
        raise experiment.error(
            ("sweep", "autoscale"), f"Ray Serve's routers are autoscaled only by Serve's own rule, {SERVE_POLICY!r}"
        )
    _check_pools(plan)
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


def _serve_unscalable(cell: Cell, scalings: dict[str, Scaling]) -> bool:
    scaling = scalings[cell.scaling]
    return cell.routing in SERVE_ROUTERS and isinstance(scaling, AutoscaleConfig) and scaling.policy != SERVE_POLICY


def _check_pools(plan: Plan) -> None:
    """Every split covers `cluster.replicas` (capacity is measured on them) and leaves a decode
    pool; pools are not autoscaled (an autoscaler sizes one pool of mixed replicas)."""
    experiment, c = plan.experiment, plan.experiment.cluster
    for i, split in enumerate(experiment.sweep.pools or []):
        prefill, decode = (int(n) for n in split.split(":"))
        if prefill + decode != c.replicas or not decode:
            raise experiment.error(
                ("sweep", "pools", i), f"{split!r} must split cluster.replicas = {c.replicas} with a decode replica"
            )
    if experiment.sweep.pools or c.prefill_replicas:
        if any(s is not None for s in plan.scalings.values()):
            raise experiment.error(("cluster", "autoscale"), "autoscaling sizes one pool of mixed replicas: no pools")
        if any(cell.routing in SERVE_ROUTERS for cell in plan.cells):
            raise experiment.error(("sweep", "routing"), "Ray Serve's routers serve one pool: they cannot run pools")
    try:
        PD_DECIDERS.check(c.pd_decider)
    except UnknownChoiceError as err:
        raise experiment.error(("cluster", "pd_decider"), str(err)) from None


_AUTOSCALE_KEYS = {
    "min": "min_replicas",
    "max": "max_replicas",
    "cooldown": "cooldown_s",
    "period": "period_s",
    "drain_timeout": "drain_timeout_s",
}


class _ColdStart(BaseModel):
    cold_start: NonNegativeFloat = Field(10.0, description="seconds a simulated replica takes to start")


def _scalings(experiment: Experiment) -> tuple[dict[str, Scaling], float]:
    """How each cell's cluster is sized, by `Cell.scaling` label, and a simulated cold start.

    `[cluster] autoscale = { policy = ..., min = ..., max = ..., ... }` is an AutoscaleConfig:
    `min` and `max` are the bounds, `cooldown`, `period` and `drain_timeout` in seconds,
    `cold_start` a simulated replica's start in seconds, every other key one of the policy's
    own parameters. Each `sweep.autoscale` entry is merged over it (so the table can hold the
    bounds alone): one with `static` is a `StaticSize` (the table's keys do not apply), any
    other an autoscaling policy. An entry is labelled by its policy ("static peak" ...), and by
    the parameters it sets itself where two entries share a policy."""
    base = dict(experiment.cluster.autoscale or {})
    try:
        cold_start_s = _ColdStart(cold_start=base.pop("cold_start", 10.0)).cold_start
    except ValidationError as err:
        raise experiment.invalid(err, ("cluster", "autoscale")) from None
    entries = experiment.sweep.autoscale
    if entries is not None and experiment.cluster.cost_scales is not None:
        raise experiment.error(("sweep", "autoscale"), "cost_scales fixes one speed per replica: it cannot be resized")
    if entries is None:
        return {"": _autoscale_config(experiment, base, ("cluster", "autoscale")) if base else None}, cold_start_s
    labelled: list[tuple[str, str, Scaling]] = []  # short label, long label, scaling
    for i, entry in enumerate(entries):
        at = ("sweep", "autoscale", i)
        if "static" in entry:
            try:
                scaling: Scaling = StaticSize(**entry)
            except ValidationError as err:
                raise experiment.invalid(err, at) from None
            short, named = f"static {scaling.static}", "static"
        else:
            scaling = _autoscale_config(experiment, {**base, **entry}, at)
            short, named = scaling.policy, "policy"
        long = " ".join([short, *(f"{k}={v}" for k, v in entry.items() if k != named)])
        if long in {x[1] for x in labelled}:
            raise experiment.error(at, f"{long!r} is listed twice")
        labelled.append((short, long, scaling))
    shorts = [s for s, _, _ in labelled]
    return {(s if shorts.count(s) == 1 else lg): x for s, lg, x in labelled}, cold_start_s


def _autoscale_config(experiment: Experiment, given: dict, at: tuple) -> AutoscaleConfig:
    names = _AUTOSCALE_KEYS
    fields = {names.get(k, k): v for k, v in given.items() if names.get(k, k) in AutoscaleConfig.model_fields}
    params = {k: v for k, v in given.items() if names.get(k, k) not in AutoscaleConfig.model_fields}
    try:
        return AutoscaleConfig(**fields, params=params)
    except ValidationError as err:
        raise experiment.invalid(err, at) from None


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
