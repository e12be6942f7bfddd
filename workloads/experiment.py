# Over 400 lines: the file's schema, its TOML/YAML parser with line numbers, and building its
# workloads sit together, so that every error names the file, the line and the key.
"""Experiment files: one workload, one cluster shape, the axes to sweep, the SLO and the plots,
read from TOML or YAML and checked in full before anything runs, so a typo costs a second, not
a half-finished sweep.

Every error names the file and line: TOML and YAML syntax errors carry their line; a value
that fails validation (an unknown key, a negative load, an unknown policy) is traced back to
the line of its key with a small key -> line scan of the text, since pydantic knows only the
key's path. Bad traces surface their TraceError (trace file and line) here too, because the
workload of every seed is built at load time.

Policy names are checked against registries the caller passes (`batching`, `routing`):
`workloads` imports neither `replica` nor `router` (docs/ARCHITECTURE.md), so `experiments.plan`
passes `replica.scheduling.policies.POLICIES` and `router.policies.ROUTING_POLICIES`.

Relative paths (a trace, a cost model) are relative to the experiment file's folder, so a
file means the same thing from any working directory."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from protocol import defaults
from protocol.flow import FlowConfig, FlowPolicy
from protocol.handover import KvLink
from workloads.spec import TenantsSpec, TraceSpec, WorkloadSpec, parse_spec
from workloads.standard import STANDARD_SPECS, standard_spec
from workloads.traces import TraceError

PLOTS = ("throughput", "latency", "cdf", "occupancy", "slot_timeline")
Loc = tuple[str | int, ...]


class ExperimentError(ValueError):
    """A bad experiment file; the message starts with `file:line:` and the key's path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkloadSection(_Section):
    """Either a standard workload by name (`standard`, its factory's `args`, then spec fields
    replaced by `override`), or a full spec (`spec`: synthetic, or `source = "trace"`). The
    seed comes from `sweep.seeds`, never from here."""

    standard: str | None = None
    args: dict[str, Any] = Field(default_factory=dict, description="the standard factory's keyword arguments")
    override: dict[str, Any] = Field(default_factory=dict, description="spec fields replaced after the factory")
    spec: dict[str, Any] | None = None

    @field_validator("standard")
    @classmethod
    def _known_standard(cls, name: str | None) -> str | None:
        return name if name is None else STANDARD_SPECS.check(name)

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadSection:
        if (self.standard is None) == (self.spec is None):
            raise ValueError("give exactly one of `standard` (a named workload) and `spec` (a full spec)")
        if self.spec is not None and (self.args or self.override):
            raise ValueError("`args` and `override` go with `standard`; a full `spec` states every field itself")
        return self


class ClusterSection(_Section):
    """The cluster every cell runs on. `model = "fake"` serves the fake model: every step
    `fake_step_seconds`, or priced by its work by `cost_model` (a `slotserve calibrate` JSON),
    on the wall clock. `cost_model` is also what `--simulate` pays per step (else the flat cost
    of the fake model); `cost_scale` multiplies its step times (0.25 plays the calibrated
    machine four times faster, with the same relative costs), or `cost_scales` each replica's
    (replicas of different speeds). `engine` takes any other EngineConfig field (max_wait,
    kv_budget_tokens, kv_cache, block_size, prefix_caching). `prefill_replicas` and
    `decode_replicas` split the replicas into pools (prefill/decode disaggregation; `replicas`
    is then their sum), `pd_decider` and `pd_threshold` choose which requests are
    disaggregated (checked by the plan), and `kv_link` is what a simulated hand-over's K/V cross
    and what the queue-aware decider prices one at, simulated and on Ray: "same_node",
    "cross_node" or a table {bandwidth_bytes_per_s, latency_s}."""

    replicas: PositiveInt = 2
    slots: PositiveInt = Field(defaults.NUM_SLOTS, description="slots per replica, unless sweep.slots is given")
    max_seq_len: int = Field(defaults.MAX_SEQ_LEN, gt=1, description="K/V tokens one slot holds")
    token_budget: PositiveInt = Field(
        defaults.TOKEN_BUDGET, description="`chunked` tokens per step, unless sweep.token_budget is given"
    )
    model: str = Field(min_length=1, description='"fake", a built-in model name or a local Hugging Face directory')
    fake_step_seconds: PositiveFloat | None = None
    cost_model: str | None = Field(
        None, min_length=1, description="cost model JSON: what --simulate and the fake model pay per step"
    )
    cost_scale: PositiveFloat = Field(1.0, description="the cost model's step times x this")
    cost_scales: list[PositiveFloat] | None = Field(
        None, description="replicas of different speeds: replica i's step times x cost_scales[i], not cost_scale"
    )
    step_overhead: NonNegativeFloat = Field(
        0.0,
        description="seconds a simulated replica's serving loop adds to each step, not scaled "
        "(the cluster's: benchmarks/experiment_fidelity.py measures it); ignored on Ray",
    )
    dispatch_delay: NonNegativeFloat = Field(
        0.0,
        description="seconds by which a simulated request is routed and queued after its arrival: its way to "
        "its replica and its first token's way back, all of it before routing; ignored on Ray",
    )
    submit_interval: NonNegativeFloat = Field(
        0.0,
        description="the client's seconds per request: simulated requests due together are routed this far "
        "apart, one after another (benchmarks/experiment_fidelity.py measures it); ignored on Ray",
    )
    dtype: defaults.Dtype = defaults.DTYPE
    device: str = "auto"
    num_cpus: PositiveFloat = Field(1.0, description="Ray CPUs per replica (= its torch threads)")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per replica (1 puts the model on cuda)")
    engine: dict[str, Any] = Field(default_factory=dict)
    autoscale: dict[str, Any] | None = Field(
        None,
        description="policy, min, max and the rest of an autoscaling.policies.AutoscaleConfig (checked by the plan)",
    )
    prefill_replicas: NonNegativeInt = Field(0, description="replicas in the prefill role (0: no pools)")
    decode_replicas: NonNegativeInt = Field(0, description="replicas in the decode role")
    pd_decider: str = Field("threshold", description="P/D decider (router.pd_decider), checked by the plan")
    pd_threshold: NonNegativeInt = Field(256, description="uncached prompt tokens from which it disaggregates")
    kv_link: Literal["same_node", "cross_node"] | KvLink = Field(
        "same_node",
        description="the link a simulated hand-over's K/V cross (protocol.handover), and the one the "
        "queue-aware P/D decider prices, simulated and on Ray",
    )

    @model_validator(mode="before")
    @classmethod
    def _replicas_of_pools(cls, data: Any) -> Any:
        """With pools and no `replicas`, the cluster is the pools."""
        if isinstance(data, dict) and "replicas" not in data and (data.get("prefill_replicas") or 0) > 0:
            return {**data, "replicas": data["prefill_replicas"] + (data.get("decode_replicas") or 0)}
        return data

    @model_validator(mode="after")
    def _pools_fit(self) -> ClusterSection:
        if not (self.prefill_replicas or self.decode_replicas):
            return self
        if not (self.prefill_replicas and self.decode_replicas):
            raise ValueError("give both prefill_replicas and decode_replicas, or neither")
        if self.prefill_replicas + self.decode_replicas != self.replicas:
            raise ValueError(
                f"replicas {self.replicas} must be prefill_replicas + decode_replicas = "
                f"{self.prefill_replicas + self.decode_replicas}"
            )
        return self

    @model_validator(mode="after")
    def _fake_step_with_fake_model(self) -> ClusterSection:
        if self.fake_step_seconds is not None and self.model != "fake":
            raise ValueError('only model "fake" takes fake_step_seconds')
        if self.model == "fake" and (self.fake_step_seconds is None) == (self.cost_model is None):
            raise ValueError('model "fake" needs exactly one of fake_step_seconds (a flat step) and cost_model')
        if self.cost_scales is not None:
            if self.model != "fake":
                raise ValueError('cost_scales sets fake replicas\' speeds: only model "fake" takes it')
            if len(self.cost_scales) != self.replicas:
                raise ValueError(f"cost_scales needs one scale per replica ({self.replicas}), got {self.cost_scales}")
            if "cost_scale" in self.model_fields_set:
                raise ValueError("give cost_scale (every replica) or cost_scales (one per replica), not both")
        return self


def _unique(values: list) -> list:
    if len(set(values)) != len(values):
        raise ValueError(f"repeated value in {values}")
    return values


def _known(names: list[str], info: ValidationInfo, kind: str) -> list[str]:
    registry = (info.context or {})[kind]  # a protocol.registry.Registry: its error names the choices
    for name in names:
        registry.check(name)
    return _unique(names)


class SweepSection(_Section):
    """The axes; cells are their product. `load` is a multiple of the cluster's measured
    capacity (leave it out for a workload with no rate: all at once, closed loop)."""

    batching: list[str] = Field(["continuous"], min_length=1)
    routing: list[str] = Field(["least_loaded"], min_length=1)
    load: list[PositiveFloat] | None = Field(None, min_length=1)
    token_budget: list[PositiveInt] | None = Field(None, min_length=1)
    slots: list[PositiveInt] | None = Field(None, min_length=1)
    seeds: list[int] = Field([0], min_length=1)
    # Argument sets of the standard workload, each merged over workload.args: e.g. the
    # output-length spread, [{sigma = 0.0}, {sigma = 0.8}] on sigma-sweep.
    workload: list[dict[str, Any]] | None = Field(None, min_length=1)
    autoscale: list[dict[str, Any]] | None = Field(
        None,
        min_length=1,
        description='ways to size the cluster, each merged over cluster.autoscale: a policy {policy = "queue_slo", '
        '...} from its min replicas, or static {static = "peak"}, "mean" or a count (checked by the plan)',
    )
    # One file compares colocated and disaggregated serving on the same traffic.
    pools: list[Annotated[str, StringConstraints(pattern=r"^\d+:\d+$")]] | None = Field(
        None, min_length=1, description='prefill:decode splits of cluster.replicas, "P:D" ("0:4": no pools)'
    )
    flow: list[FlowPolicy] | None = Field(
        None, min_length=1, description="flow-control policies, each over the [flow] table (protocol.flow)"
    )

    @field_validator("batching")
    @classmethod
    def _known_batching(cls, names: list[str], info: ValidationInfo) -> list[str]:
        return _known(names, info, "batching")

    @field_validator("routing")
    @classmethod
    def _known_routing(cls, names: list[str], info: ValidationInfo) -> list[str]:
        return _known(names, info, "routing")

    @field_validator("load", "token_budget", "slots", "seeds", "pools", "flow")
    @classmethod
    def _no_repeats(cls, values: list | None) -> list | None:
        return values if values is None else _unique(values)


class SLOSection(_Section):
    ttft: PositiveFloat = 2.0
    tpot: PositiveFloat = defaults.TPOT_SLO
    e2e: PositiveFloat | None = None


class Experiment(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="also the report's folder name")
    description: str = ""
    workload: WorkloadSection
    cluster: ClusterSection
    # Not SweepSection(): its policy checks need the registries, which only load_experiment has.
    sweep: SweepSection = SweepSection.model_construct()
    slo: SLOSection = SLOSection()
    # Flow control at the router (protocol.flow); sweep.flow replaces its policy cell by cell.
    flow: FlowConfig | None = None
    plots: list[Literal[PLOTS]] = Field(list(PLOTS), description="which figures the report has")

    @field_validator("plots")
    @classmethod
    def _no_repeated_plots(cls, plots: list[str]) -> list[str]:
        return _unique(plots)

    _path: Path = PrivateAttr()
    _allow_outside_paths: bool = PrivateAttr(False)
    _lines: dict[Loc, int] = PrivateAttr()
    _spec: WorkloadSpec | TraceSpec | TenantsSpec = PrivateAttr()

    @property
    def path(self) -> Path:
        return self._path

    def resolve(self, path: str, loc: Loc) -> Path:
        """A path the file names (at key `loc`), relative to the file's folder. It may not
        leave that folder (an absolute path, `..` or a link out of it), unless the file was
        loaded with `allow_outside_paths`: a file someone hands you cannot make slotserve read
        whatever it likes."""
        folder = self._path.parent.resolve()
        resolved = (folder / Path(path).expanduser()).resolve()
        if not self._allow_outside_paths and not resolved.is_relative_to(folder):
            raise self.error(
                loc,
                f"{path!r} leaves the experiment file's folder {folder}; keep the file there or allow "
                "outside paths (`slotserve experiment --allow-outside-paths`)",
            )
        return resolved

    def error(self, loc: Loc, message: str) -> ExperimentError:
        """An error at the line of the key `loc` (or of its nearest enclosing key)."""
        return ExperimentError(f"{self._path}:{_line_of(self._lines, loc)}: {_dotted(loc)}: {message}")

    def invalid(self, err: ValidationError, at: Loc = ()) -> ExperimentError:
        """A validation error of something built from the key `at` (its paths are below it)."""
        return _first_error(self._path, self._lines, err, at)

    def workload_spec(self, seed: int, args: dict[str, Any] | None = None) -> WorkloadSpec | TraceSpec | TenantsSpec:
        """The workload of one seed and one of sweep.workload's argument sets (a trace is
        fixed: the seed then only seeds the run's prompts)."""
        spec = _standard(self, args) if args else self._spec
        return spec.replace(seed=seed) if isinstance(spec, (WorkloadSpec, TenantsSpec)) else spec

    def workload_variants(self) -> list[dict[str, Any]]:
        """sweep.workload's argument sets, or one empty set."""
        return self.sweep.workload or [{}]


def load_experiment(
    path: str | Path,
    *,
    batching: Collection[str],
    routing: Collection[str],
    seeds: list[int] | None = None,
    loads: list[float] | None = None,
    allow_outside_paths: bool = False,
) -> Experiment:
    """Read, validate and build an experiment file (`.toml`, `.yaml` or `.yml`; parsed, never
    executed): every key, the policy names (against `batching` and `routing`), and the workload
    of every seed. `seeds` and `loads` replace the file's sweep.seeds and sweep.load (command-line
    overrides, checked like the file's own); paths in the file stay inside its folder unless
    `allow_outside_paths`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ExperimentError(f"{path}: cannot read the experiment file: {err.strerror}") from None
    data, lines = _parse(path, text)
    overrides = {key: value for key, value in (("seeds", seeds), ("load", loads)) if value is not None}
    if overrides and isinstance(data.get("sweep", {}), dict):
        data["sweep"] = {**data.get("sweep", {}), **overrides}
    try:
        experiment = Experiment.model_validate(data, context={"batching": batching, "routing": routing})
    except ValidationError as err:
        raise _first_error(path, lines, err, ()) from None
    experiment._path, experiment._lines = path, lines
    experiment._allow_outside_paths = allow_outside_paths
    experiment._spec = _base_spec(experiment)
    _check_workloads(experiment)
    return experiment


# --- the workload -------------------------------------------------------------------------


def _base_spec(experiment: Experiment) -> WorkloadSpec | TraceSpec | TenantsSpec:
    section = experiment.workload
    if section.spec is not None:
        if "seed" in section.spec:
            raise experiment.error(("workload", "spec", "seed"), "seeds come from sweep.seeds")
        data = dict(section.spec)
        if data.get("source") == "trace" and data.get("path") is not None:
            data["path"] = str(experiment.resolve(data["path"], ("workload", "spec", "path")))
        return _validated(experiment, ("workload", "spec"), lambda: parse_spec(data))
    for key in ("args", "override"):
        if "seed" in getattr(section, key):
            raise experiment.error(("workload", key, "seed"), "seeds come from sweep.seeds")
    return _standard(experiment, {})


def _standard(experiment: Experiment, args: dict[str, Any]) -> WorkloadSpec | TraceSpec | TenantsSpec:
    """The standard workload with workload.args, then `args` (one of sweep.workload's sets), then
    workload.override. A set with its own `standard` names another standard workload, made
    from that set's arguments alone (so one file can compare workloads)."""
    section = experiment.workload
    at = ("sweep", "workload") if args else ("workload", "args")
    if section.standard is None:
        raise experiment.error(at, "sweep.workload varies a standard workload's arguments; this one is a full spec")
    if "seed" in args:
        raise experiment.error(at, "seeds come from sweep.seeds")
    name, merged = section.standard, {**section.args, **args}
    if "standard" in args:
        try:
            name = STANDARD_SPECS.check(args["standard"])
        except ValueError as err:
            raise experiment.error(at, str(err)) from None
        merged = {k: v for k, v in args.items() if k != "standard"}
    try:
        spec = standard_spec(name, **merged)
    except ValidationError as err:  # a value the spec refuses, under the argument's name
        raise experiment.invalid(err, at) from None
    except TypeError as err:  # an argument the factory does not take
        raise experiment.error(at, f"{name}: {err}") from None
    except ValueError as err:  # the factory's own check (azure-conv's fixed seed)
        raise experiment.error(at, str(err)) from None
    return _validated(experiment, ("workload", "override"), lambda: spec.replace(**section.override))


def _validated(experiment: Experiment, at: Loc, make):
    """`make()`, its validation errors placed under the key `at`."""
    try:
        return make()
    except ValidationError as err:
        raise experiment.invalid(err, at) from None


def _check_workloads(experiment: Experiment) -> None:
    """Build the workload of every seed (and at a load, when the sweep has one), so a bad
    trace or a spec that cannot run at a load fails now, before any run."""
    loads = experiment.sweep.load
    specs = {
        s.model_dump_json(): s
        for s in (
            experiment.workload_spec(seed, args)
            for seed in experiment.sweep.seeds
            for args in experiment.workload_variants()
        )
    }  # a trace: one
    for spec in specs.values():
        if loads and not spec.has_rate:
            raise experiment.error(
                ("sweep", "load"),
                f"workload {spec.name!r} has no arrival rate (all at once or "
                "closed loop), so it cannot run at a load: remove sweep.load",
            )
        try:
            (spec.at_load(loads[0], 1.0) if loads else spec).build()
        except TraceError as err:
            raise experiment.error(("workload", "spec", "path"), str(err)) from None
        except ValueError as err:
            raise experiment.error(("sweep", "load") if loads else ("workload",), str(err)) from None


# --- parsing, and where each key is -------------------------------------------------------

_TOML_AT = re.compile(r"\s*\(at line (\d+), column \d+\)$")
_TOML_HEADER = re.compile(r"""^\s*\[\[?\s*([A-Za-z0-9_."' -]+?)\s*\]\]?\s*(#.*)?$""")
_TOML_PART = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""  # a bare or quoted key
_TOML_KEY = re.compile(rf"^\s*({_TOML_PART}(?:\s*\.\s*{_TOML_PART})*)\s*=")


def _parse(path: Path, text: str) -> tuple[dict, dict[Loc, int]]:
    """The file's data and the line of each key path."""
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            match = _TOML_AT.search(str(err))
            line = match.group(1) if match else len(text.splitlines()) or 1  # else "at end of document"
            message = _TOML_AT.sub("", str(err)).removesuffix(" (at end of document)")
            raise ExperimentError(f"{path}:{line}: TOML syntax: {message}") from None
        return data, _toml_lines(text)
    if path.suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(text)
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            line = mark.line + 1 if mark is not None else 1
            raise ExperimentError(f"{path}:{line}: YAML syntax: {getattr(err, 'problem', None) or err}") from None
        if not isinstance(data, dict):
            raise ExperimentError(f"{path}:1: an experiment file is a mapping of keys (name, workload, cluster, ...)")
        lines: dict[Loc, int] = {}
        _yaml_lines(node, (), lines)
        return data, lines
    raise ExperimentError(f"{path}: an experiment file ends in .toml, .yaml or .yml")


def _toml_key(text: str) -> tuple[str, ...]:
    """`a.b."c.d"` -> ("a", "b", "c.d")."""
    return tuple(part.strip("\"'") for part in re.findall(r'"[^"]*"|\'[^\']*\'|[^.\s]+', text))


def _toml_lines(text: str) -> dict[Loc, int]:
    """Table headers and `key =` lines (dotted keys included), first occurrence wins. Keys
    inside inline tables and arrays are found by their enclosing key, which is on the same line."""
    lines: dict[Loc, int] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        if header := _TOML_HEADER.match(line):
            table = _toml_key(header.group(1))
            lines.setdefault(table, number)
        elif key := _TOML_KEY.match(line):
            lines.setdefault(table + _toml_key(key.group(1)), number)
    return lines


def _yaml_lines(node: yaml.Node, at: Loc, lines: dict[Loc, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            here = at + (key.value,)
            lines.setdefault(here, key.start_mark.line + 1)
            _yaml_lines(value, here, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.setdefault(at + (i,), item.start_mark.line + 1)
            _yaml_lines(item, at + (i,), lines)


def _line_of(lines: dict[Loc, int], loc: Loc) -> int:
    """The line of `loc`'s deepest key found in the file. Parts that are not keys there (a
    union's tag, a list index in TOML, a key left out) are stepped over, so a missing key
    points at its table and a bad list item at its list."""
    at: Loc = ()
    for part in loc:
        if at + (part,) in lines:
            at += (part,)
    return lines.get(at, 1)


def _dotted(loc: Loc) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or "(file)"


def _first_error(path: Path, lines: dict[Loc, int], err: ValidationError, at: Loc) -> ExperimentError:
    """One line: the first validation error at its key's line, and how many more there are."""
    errors = err.errors()
    first = errors[0]
    loc = at + tuple(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    elif first["type"] == "missing":
        message = "required key missing"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ExperimentError(f"{path}:{_line_of(lines, loc)}: {_dotted(loc)}: {message}{more}")
