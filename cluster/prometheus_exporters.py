"""Live metrics through Ray's metrics system: the replica's and the router's exporters, and
the Prometheus service-discovery file that lists every node's metrics port.

Each actor is given a factory (`replica_telemetry`, `router_telemetry`) and builds its exporter
in its own process; the actor calls the hooks of `protocol.telemetry_hooks` and all the logic is
here. Ray serves what is recorded on each node's metrics export port (`ray_` + the name; the
scrape configuration in `dashboards/` renames it back). The names, labels and buckets are
`metrics.live.METRICS`.

Per-request times are the replica's: arrival as the request carries it (the client's stamp
when one is given, on the same wall clock) and the engine's own token times, so TTFT here
leaves out the token's trip back to the client that the store's client-side TTFT includes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import ray

from metrics.definitions import SLO, RequestTrace
from metrics.live import METRICS, NO_RUN, PROBE_RUN, LiveMetric, is_probe
from protocol.errors import SlotServeError
from protocol.handover import KvFetch
from protocol.routing import RouteRequest
from protocol.scaling import ColdStart, ScalingDecision
from protocol.telemetry_hooks import ReplicaTelemetry, RouterTelemetry
from replica.engine import Engine, RequestOutput, StepRecord
from replica.scheduling.request import FinishReason, Request
from replica.serving.loop import ReplicaConfig

SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # Ray's own name for it
# Seconds between re-sends of the gauges: Ray's metrics agent drops a gauge not set again within
# two export intervals, and an idle replica sets none.
GAUGE_REFRESH = 0.5
MIGRATED = FinishReason.MIGRATE.value  # a drained replica's requests end here and resume elsewhere

_CREATED: dict[str, Any] = {}  # one Ray metric object per name and process


def _ray_metric(definition: LiveMetric):
    """The process's Ray metric for `definition` (Ray wants each name registered once)."""
    if definition.name not in _CREATED:
        from ray.util import metrics as ray_metrics

        if definition.kind == "gauge":
            made = ray_metrics.Gauge(definition.ray_name, definition.help, tag_keys=definition.labels)
        elif definition.kind == "counter":
            made = ray_metrics.Counter(definition.ray_name, definition.help, tag_keys=definition.labels)
        else:
            made = ray_metrics.Histogram(
                definition.ray_name, definition.help, boundaries=list(definition.buckets), tag_keys=definition.labels
            )
        _CREATED[definition.name] = made
    return _CREATED[definition.name]


class _Series:
    """Ray metric objects by short name (`slotserve_` left off), recorded with tag dicts made
    once per label set: a step's hooks cost a few microseconds per metric."""

    def __init__(self, names: list[str]):
        self._metric = {name: _ray_metric(METRICS["slotserve_" + name]) for name in names}

    def inc(self, name: str, value: float, tags: dict[str, str]) -> None:
        if value > 0:
            self._metric[name].inc(value, tags=tags)

    def observe(self, name: str, value: float, tags: dict[str, str]) -> None:
        self._metric[name].observe(max(0.0, value), tags=tags)

    def set(self, name: str, value: float, tags: dict[str, str]) -> None:
        self._metric[name].set(value, tags=tags)


_OWN_PREFIX = {"router": "router_", "autoscaler": "autoscaler_"}  # the rest is a replica's


def _names(kind: str) -> list[str]:
    short = [name.removeprefix("slotserve_") for name in METRICS]
    if kind in _OWN_PREFIX:
        return [n for n in short if n.startswith(_OWN_PREFIX[kind])]
    return [n for n in short if not n.startswith(tuple(_OWN_PREFIX.values()))]


@dataclass
class _Tracked:
    """A request the replica is serving, and how much of it has been observed."""

    request: Request
    probe: bool = False  # one of a capacity probe's requests (`metrics.live.is_probe`)
    seen: int = 0  # token times already observed
    queued: bool = False  # queue time observed


class ReplicaExporter(ReplicaTelemetry):
    """A replica's metrics, read from its engine at each hook (the engine is between steps
    whenever a hook runs, except `on_submit`, which only looks a request up).

    While a capacity probe's requests are in flight, counters and histograms carry
    `run="probe"`: a probe saturates the cluster on its own before a run begins, and its queue
    and latencies are not the run's."""

    def __init__(self, replica_id: str, engine: Engine, model: str, slo: SLO, refresh: float | None = GAUGE_REFRESH):
        self.engine = engine
        self.slo = slo
        self.series = _Series(_names("replica"))
        self._labels = {
            "replica": replica_id,
            "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else "",
            "model": model,
            "batching_policy": engine.config.policy,
        }
        self._requests: dict[str, _Tracked] = {}
        self._unqueued: list[float] = []  # arrivals of requests that ended in their first step
        self._prefix_hits = engine.scheduler.num_prefix_cached_tokens
        self._gauges: dict[str, float] = {}
        self._last_step: StepRecord | None = None  # the step whose load report comes next
        self._probes = 0  # probe requests in flight
        self.totals = {"steps": 0, "generation_tokens": 0, "finished": 0}
        self.set_run(None)
        if refresh is not None:
            threading.Thread(target=self._refresh, args=(refresh,), daemon=True, name="slotserve-gauges").start()

    def set_run(self, run_id: int | None) -> None:
        self._run = NO_RUN if run_id is None else str(run_id)
        self._label_run(PROBE_RUN if self._probes else self._run)

    def _label_run(self, run: str) -> None:
        self._run_tags = {**self._labels, "run": run}
        self._tags_with: dict[tuple[str, str], dict[str, str]] = {}

    def _with(self, label: str, value: str) -> dict[str, str]:
        key = (label, value)
        if key not in self._tags_with:
            self._tags_with[key] = {**self._run_tags, label: value}
        return self._tags_with[key]

    # ---- hooks ----------------------------------------------------------------------------
    def on_submit(self, request_id: str) -> None:
        request = self.engine.requests.get(request_id)
        if request is None:
            return
        probe = is_probe(request_id)
        self._requests[request_id] = _Tracked(request, probe)
        if probe:
            self._probes += 1
            if self._probes == 1:
                self._label_run(PROBE_RUN)

    def on_reject(self, request_id: str) -> None:
        self._ended("rejected", met=False, tokens=0)

    def on_step(self, record: StepRecord) -> None:
        tags, series = self._run_tags, self.series
        series.inc("steps_total", 1, tags)
        series.inc("step_live_slots_total", record.live_slots, tags)
        series.inc("prefill_tokens_total", record.num_prefill_tokens, tags)
        series.inc("num_preemptions_total", record.num_preemptions, tags)
        hits = self.engine.scheduler.num_prefix_cached_tokens
        series.inc("prefix_cache_hits_total", hits - self._prefix_hits, tags)
        self._prefix_hits = hits
        series.observe("step_time_seconds", record.duration, tags)
        series.observe("iteration_tokens_total", record.num_decode_tokens + record.num_prefill_tokens, tags)
        for arrival in self._unqueued:
            series.observe("request_queue_time_seconds", record.start - arrival, tags)
        self._unqueued.clear()
        new_tokens = 0
        for request in self.engine.scheduler.running:
            tracked = self._requests.get(request.request_id)
            if tracked is not None:
                new_tokens += self._observe(tracked, record.start)
        series.inc("generation_tokens_total", new_tokens, tags)
        self.totals["steps"] += 1
        self.totals["generation_tokens"] += new_tokens
        self._last_step = record

    def on_finish(self, output: RequestOutput) -> None:
        reason = output.finish_reason.value if output.finish_reason else "error"
        tracked = self._requests.pop(output.request_id, None)
        if tracked is None:  # never seen accepted: count its end only
            self._ended(reason, met=False, tokens=0)
            return
        request = tracked.request
        new_tokens = self._observe(tracked, None)
        self.series.inc("generation_tokens_total", new_tokens, self._run_tags)
        self.totals["generation_tokens"] += new_tokens
        if not tracked.queued and request.token_times:
            self._unqueued.append(request.arrival_time)  # its step's start comes with on_step
        trace = RequestTrace(
            output.request_id, request.arrival_time, request.token_times, output.time, reason, request.num_prompt_tokens
        )
        self.series.observe("e2e_request_latency_seconds", trace.e2e, self._run_tags)
        if trace.tpot is not None:
            self.series.observe("request_time_per_output_token_seconds", trace.tpot, self._run_tags)
        self._ended(reason, self.slo.met_by(trace), trace.num_output_tokens)
        if tracked.probe:
            self._probes -= 1
            if not self._probes:
                self._label_run(self._run)

    def on_handover(self, fetch: KvFetch) -> None:
        tags = self._run_tags
        self.series.inc("kv_handovers_total", 1, self._with("outcome", "kv" if fetch.fallback is None else "recompute"))
        self.series.inc("kv_handover_bytes_total", fetch.nbytes, tags)
        self.series.observe("kv_handover_seconds", fetch.seconds, tags)

    def on_load(self, load: Any) -> None:
        # Right after a step, its slots say what the replica was doing: a request that ended
        # in the step held its slot through it and is gone by its end, while the next ones
        # are admitted only when the next step starts, so the state between two steps would
        # read a busy replica of short requests as idle beside full occupancy.
        step, self._last_step = self._last_step, None
        slots = self.engine.scheduler.slots
        held = load.num_slots - load.free_slots if step is None else step.live_slots
        self._set("num_requests_running", load.running if step is None else step.live_slots)
        self._set("num_requests_waiting", load.queue_depth)
        self._set("slots_used", held)
        self._set("slots_total", load.num_slots)
        self._set("kv_tokens_reserved", slots.used_kv_tokens)
        self._set("kv_tokens_total", slots.kv_budget_tokens)
        self._set("kv_cache_usage_perc", slots.used_kv_tokens / slots.kv_budget_tokens)
        self._set("kv_tokens_used", sum(r.num_computed_tokens for r in list(self.engine.scheduler.running)))

    def snapshot(self) -> dict:
        return {**self.totals, **{name: value for name, value in self._gauges.items() if name.startswith("kv_")}}

    # ---- helpers --------------------------------------------------------------------------
    def _observe(self, tracked: _Tracked, step_start: float | None) -> int:
        """Observe what is new about a request since the last look: its queue time once it
        has run a step, its first token, and each new inter-token gap. Returns the new tokens."""
        request, tags = tracked.request, self._run_tags
        if not tracked.queued and step_start is not None and (request.num_computed_tokens or request.token_times):
            self.series.observe("request_queue_time_seconds", step_start - request.arrival_time, tags)
            tracked.queued = True
        times = request.token_times
        if len(times) <= tracked.seen:
            return 0
        if tracked.seen == 0:
            self.series.observe("time_to_first_token_seconds", times[0] - request.arrival_time, tags)
            self.series.inc("prompt_tokens_total", request.num_prompt_tokens, tags)
        for k in range(max(1, tracked.seen), len(times)):
            self.series.observe("inter_token_latency_seconds", times[k] - times[k - 1], tags)
        new, tracked.seen = len(times) - tracked.seen, len(times)
        return new

    def _ended(self, reason: str, met: bool, tokens: int) -> None:
        self.series.inc("requests_finished_total", 1, self._with("finished_reason", reason))
        self.totals["finished"] += 1
        if reason == MIGRATED:  # it goes on on another replica, which judges it
            return
        outcome = self._with("slo", "met" if met else "missed")
        self.series.inc("slo_requests_total", 1, outcome)
        self.series.inc("slo_tokens_total", tokens, outcome)

    def _refresh(self, period: float) -> None:
        while True:
            time.sleep(period)
            for name, value in list(self._gauges.items()):
                self.series.set(name, value, self._labels)

    def _set(self, name: str, value: float) -> None:
        if self._gauges.get(name) != value:  # an unchanged gauge costs nothing
            self._gauges[name] = value
            self.series.set(name, value, self._labels)


class RouterExporter(RouterTelemetry):
    """The router's metrics: every decision timed and counted by replica and policy (a capacity
    probe's under `run="probe"`, as the replicas count them)."""

    def __init__(self, router: Any):
        self.router = router
        self.series = _Series(_names("router"))
        self.set_run(None)

    def set_run(self, run_id: int | None) -> None:
        self._run = NO_RUN if run_id is None else str(run_id)
        self._tags: dict[tuple[str, ...], dict[str, str]] = {}

    def _tags_for(self, policy: str, probe: bool, replica: str | None = None) -> dict[str, str]:
        key = (policy, probe, replica)
        if key not in self._tags:
            self._tags[key] = {"routing_policy": policy, "run": PROBE_RUN if probe else self._run} | (
                {} if replica is None else {"replica": replica}
            )
        return self._tags[key]

    def route(self, route: Callable[..., Any], request: RouteRequest) -> Any:
        started = time.perf_counter()
        probe = is_probe(request.request_id)
        try:
            decision = route(request)
        except SlotServeError:
            self.series.inc("router_rejections_total", 1, self._tags_for(self.router.policy.name, probe))
            raise
        if decision is None:  # held by flow control: counted there
            return None
        elapsed = time.perf_counter() - started
        tags = self._tags_for(decision.policy, probe)
        self.series.inc("router_dispatches_total", 1, self._tags_for(decision.policy, probe, decision.replica_id))
        self.series.observe("router_decision_time_seconds", elapsed, tags)
        if decision.signal_age is not None:
            self.series.observe("router_signal_age_seconds", decision.signal_age, tags)
        return decision

    def flow(self, priority: int, tenant: str, outcome: str) -> None:
        tags = {"routing_policy": self.router.policy.name, "run": self._run}
        self.series.inc(
            "router_flow_requests_total", 1, {**tags, "priority": str(priority), "tenant": tenant, "outcome": outcome}
        )

    def flow_held(self, held_by_band: dict[int, int]) -> None:
        for band, count in held_by_band.items():
            self.series.set("router_flow_held", count, {"priority": str(band)})


class AutoscalerExporter:
    """The autoscaling controller's metrics (`cluster.autoscaler`): its replicas by state, set
    every decision period; each decision counted by direction; each started replica's cold start."""

    def __init__(self, policy: str):
        self.policy = policy
        self.series = _Series(_names("autoscaler"))

    def _tags(self, run_id: int | None, **extra: str) -> dict[str, str]:
        return {"autoscaling_policy": self.policy, "run": NO_RUN if run_id is None else str(run_id), **extra}

    def set_replicas(self, by_state: dict[str, int]) -> None:
        for state, count in by_state.items():
            self.series.set("autoscaler_replicas", count, {"autoscaling_policy": self.policy, "state": state})

    def on_decision(self, decision: ScalingDecision, run_id: int | None) -> None:
        direction = "up" if decision.change > 0 else "down" if decision.change < 0 else "hold"
        self.series.inc("autoscaler_decisions_total", 1, self._tags(run_id, direction=direction))

    def on_cold_start(self, cold: ColdStart, run_id: int | None) -> None:
        self.series.observe("autoscaler_cold_start_seconds", cold.ready_s, self._tags(run_id))


def model_label(config: ReplicaConfig) -> str:
    """The `model` label: the built-in name or the directory's name, or the fake model."""
    if config.fake_step_seconds is not None:
        return "fake-flat"
    if config.fake_cost is not None:
        return "fake-linear"
    return Path(config.engine.model).name or config.engine.model


def replica_telemetry(config: ReplicaConfig, slo: SLO) -> Callable[[str, Engine], ReplicaExporter]:
    """What a replica actor is given: it calls this with its id and engine."""
    return partial(ReplicaExporter, model=model_label(config), slo=slo)


def router_telemetry() -> Callable[[Any], RouterExporter]:
    """What the router actor is given: it calls this with its `Router`."""
    return RouterExporter


def service_discovery_path() -> Path:
    """Where this Ray session's service-discovery file lives (Ray's dashboard writes the same
    file when it runs; slotserve starts Ray without it)."""
    context = ray.get_runtime_context()
    return Path(context.get_temp_dir()) / context.get_session_name() / SERVICE_DISCOVERY_FILE


def write_service_discovery(path: Path | None = None) -> Path:
    """Write (or extend) Prometheus's file-based service discovery with every live node's
    metrics export port, in Ray's format, atomically (Prometheus may read it at any time)."""
    path = path or service_discovery_path()
    targets = [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]]
    groups = json.loads(path.read_text()) if path.exists() else []
    known = {t for group in groups for t in group.get("targets", [])}
    missing = [t for t in targets if t not in known]
    if missing or not groups:
        groups.append({"labels": {"job": "ray"}, "targets": missing})
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, path)
    return path
