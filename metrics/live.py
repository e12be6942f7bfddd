"""The live metrics a running cluster exports to Prometheus: names, kinds, labels and buckets,
in one place (plain data, no Ray), so the exporters (`cluster.prometheus_exporters`), the dashboards
(`dashboards`) and the tests all read the same table.

Names follow vLLM's where one exists (`num_requests_running`, `time_to_first_token_seconds`,
`generation_tokens_total`, ...) with the prefix `slotserve_`. A name here is the name Prometheus
shows: counters end in `_total`, histograms add `_bucket`, `_sum` and `_count`. Ray exports every
application metric as `ray_<name>`; the scrape configuration in `dashboards/` renames
`ray_slotserve_*` back to `slotserve_*`.

Labels: every replica series carries `replica`, `node` (Ray node id), `model` and
`batching_policy`; counters and histograms also carry `run` (the store's run id, `none` outside
a run, `probe` while a capacity probe's requests run), so one run's counts can be read apart
from the next and from the saturating probe that sets its load. Gauges carry no `run`: they are
the replica's state now (after a step: the slots that step held), and a gauge left behind under
an old run's label would read as a second replica. The router's series carry `routing_policy`
and `run`; the autoscaling controller's `autoscaling_policy` (and `run`, or `state` on its
replica gauge). Ray adds `SessionName` (the cluster), `NodeAddress` and `WorkerId`.

The replicas and the router export every `EXPORT_INTERVAL_MS` whatever the Ray cluster's own
interval (`RAY_metrics_report_interval_ms`, 10 s unless set), which is what the dashboards'
rate windows assume.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "slotserve_"
NO_RUN = "none"  # the run label outside a run
PROBE_RUN = "probe"  # the run label of a capacity probe's requests
PROBE_REQUEST_PREFIX = "probe-"  # a capacity probe's request ids start with it
EXPORT_INTERVAL_MS = 1000  # how often the actors send their metrics to Ray's metrics agent


def is_probe(request_id: str) -> bool:
    """Whether the request is one of a capacity probe's (its live metrics are labelled `probe`)."""
    return request_id.startswith(PROBE_REQUEST_PREFIX)


REPLICA_LABELS = ("replica", "node", "model", "batching_policy")
RUN_LABELS = (*REPLICA_LABELS, "run")
ROUTER_LABELS = ("routing_policy", "run")
AUTOSCALER_LABELS = ("autoscaling_policy", "run")

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)
AGE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COLD_START_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass(frozen=True)
class LiveMetric:
    name: str  # as Prometheus shows it (after the scrape's rename)
    kind: str  # "gauge", "counter" or "histogram"
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def ray_name(self) -> str:
        """The name `ray.util.metrics` is given: Ray appends `_total` to a counter itself."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


def _gauge(name: str, help: str) -> LiveMetric:
    return LiveMetric(PREFIX + name, "gauge", help, REPLICA_LABELS)


def _counter(name: str, help: str, *extra: str, labels: tuple[str, ...] = RUN_LABELS) -> LiveMetric:
    return LiveMetric(PREFIX + name, "counter", help, (*labels, *extra))


def _histogram(name: str, help: str, buckets: tuple[float, ...], labels: tuple[str, ...] = RUN_LABELS) -> LiveMetric:
    return LiveMetric(PREFIX + name, "histogram", help, labels, buckets)


METRICS: dict[str, LiveMetric] = {
    m.name: m
    for m in (
        # ---- replica state, at every step boundary and when it goes idle
        _gauge("num_requests_running", "requests holding a slot (vLLM's num_requests_running)"),
        _gauge("num_requests_waiting", "requests queued for a slot, submissions not yet queued included"),
        _gauge("slots_used", "K/V cache slots held by requests"),
        _gauge("slots_total", "K/V cache slots of the replica"),
        _gauge("kv_cache_usage_perc", "share of the K/V budget reserved, 0 to 1 (vLLM's kv_cache_usage_perc)"),
        _gauge("kv_tokens_used", "K/V tokens computed and held by running requests"),
        _gauge("kv_tokens_reserved", "K/V tokens reserved (slot rows or blocks taken)"),
        _gauge("kv_tokens_total", "K/V tokens the replica's budget holds"),
        # ---- replica counters
        _counter("steps_total", "engine steps (forward passes)"),
        _counter("step_live_slots_total", "live slots summed over steps: with steps_total, the mean occupancy"),
        _counter("prompt_tokens_total", "prompt tokens of requests that got their first token"),
        _counter("generation_tokens_total", "output tokens generated"),
        _counter("prefill_tokens_total", "prompt tokens run through the model, recomputation included"),
        _counter("prefix_cache_hits_total", "prompt tokens whose K/V came from the prefix cache"),
        _counter("num_preemptions_total", "requests preempted (K/V freed, recomputed later)"),
        _counter("requests_finished_total", "requests ended, by reason", "finished_reason"),
        _counter("slo_requests_total", "ended requests that met or missed the cluster's SLO", "slo"),
        _counter("slo_tokens_total", "output tokens of requests that met or missed the cluster's SLO", "slo"),
        # ---- replica histograms
        _histogram("step_time_seconds", "engine step (forward pass) time", STEP_BUCKETS),
        _histogram("iteration_tokens_total", "tokens per engine step, decodes and prefill", TOKEN_BUCKETS),
        _histogram("time_to_first_token_seconds", "arrival to first token (replica's token time)", LATENCY_BUCKETS),
        _histogram("inter_token_latency_seconds", "gap between consecutive tokens of a request", LATENCY_BUCKETS),
        _histogram(
            "request_time_per_output_token_seconds", "(last - first token) / (tokens - 1) per request", LATENCY_BUCKETS
        ),
        _histogram("e2e_request_latency_seconds", "arrival to the request's end", LATENCY_BUCKETS),
        _histogram("request_queue_time_seconds", "arrival to the start of the request's first step", LATENCY_BUCKETS),
        # ---- prefill/decode hand-overs, counted by the replica that took the request in
        _counter(
            "kv_handovers_total", "requests handed over here, by outcome (kv: K/V taken in; recompute)", "outcome"
        ),
        _counter("kv_handover_bytes_total", "K/V bytes taken in from hand-overs"),
        _histogram("kv_handover_seconds", "a hand-over's K/V fetch from the replica that made it", LATENCY_BUCKETS),
        # ---- router
        _counter("router_dispatches_total", "requests routed, by replica", "replica", labels=ROUTER_LABELS),
        _counter("router_rejections_total", "route calls refused", labels=ROUTER_LABELS),
        _histogram("router_decision_time_seconds", "time to choose a replica", DECISION_BUCKETS, ROUTER_LABELS),
        _histogram(
            "router_signal_age_seconds", "age of the oldest load report a decision used", AGE_BUCKETS, ROUTER_LABELS
        ),
        # ---- the router's flow control (`protocol.flow`), by request class
        _counter(
            "router_flow_requests_total",
            "requests through flow control, by outcome (dispatched at once, held, released from hold, refused)",
            "priority",
            "tenant",
            "outcome",
            labels=ROUTER_LABELS,
        ),
        LiveMetric(PREFIX + "router_flow_held", "gauge", "requests held for dispatch now, by band", ("priority",)),
        # ---- autoscaling controller
        LiveMetric(PREFIX + "autoscaler_replicas", "gauge", "replicas by state", ("autoscaling_policy", "state")),
        _counter(
            "autoscaler_decisions_total",
            "scaling decisions, by direction (up, down, hold)",
            "direction",
            labels=AUTOSCALER_LABELS,
        ),
        _histogram(
            "autoscaler_cold_start_seconds",
            "a started replica's request to its first traffic",
            COLD_START_BUCKETS,
            AUTOSCALER_LABELS,
        ),
    )
}


def metric(name: str) -> LiveMetric:
    """The definition of `name` (with or without the `slotserve_` prefix)."""
    return METRICS[name if name.startswith(PREFIX) else PREFIX + name]
