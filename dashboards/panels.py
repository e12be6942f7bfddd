"""The dashboard's panels as data: a title, a kind and the PromQL of each line. This is the one
source of `grafana/slotserve.json` (`python -m dashboards.build` writes it), of what
`slotserve dashboard render` draws and of what the tests evaluate against a live Prometheus.

Every query filters by the dashboard's variables through `select`, which puts on a metric
only the labels it has (`metrics.live`): `$cluster` (Ray's `SessionName`), `$model`,
`$replica` and `$run`. A legend names the labels a line is split by (`{{replica}}`), and so
says what a query must return: one series per value of each such label.
"""

from __future__ import annotations

from dataclasses import dataclass

from metrics.live import metric

WINDOW = "$__rate_interval"  # Grafana's rate window; render and the tests put a fixed one in


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # "timeseries", "heatmap" or "bargauge"
    unit: str  # Grafana unit: "percentunit", "s", "short", "reqps", ...
    targets: tuple[Target, ...]
    description: str = ""


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


def select(name: str, suffix: str = "", **fixed: str) -> str:
    """`name{...}` (a histogram's series: `suffix` "_bucket") with the dashboard's variables on
    the labels the metric has, and `fixed` label values (`slo="met"`)."""
    labels = metric(name).labels
    matchers = ['SessionName=~"$cluster"']
    matchers += [f'{label}=~"${label}"' for label in ("model", "replica", "run") if label in labels]
    matchers += [f'{label}="{value}"' for label, value in fixed.items()]
    return f"{metric(name).name}{suffix}{{{', '.join(matchers)}}}"


def rate(name: str, by: str = "", suffix: str = "", **fixed: str) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({select(name, suffix, **fixed)}[{WINDOW}]))"


def now(name: str) -> str:
    """A replica gauge's value now, one line per replica."""
    return f"max by (replica) ({select(name)})"


def quantile(q: float, name: str, by: str = "") -> str:
    return f"histogram_quantile({q}, {rate(name, by=', '.join(filter(None, (by, 'le'))), suffix='_bucket')})"


def p50_p99(name: str) -> tuple[Target, ...]:
    return (Target(quantile(0.5, name), "p50"), Target(quantile(0.99, name), "p99"))


OCCUPANCY = (
    f"{rate('step_live_slots_total', by='replica')} / {rate('steps_total', by='replica')} / {now('slots_total')}"
)
PER_REPLICA = "{{replica}}"

ROWS = (
    Row(
        "Occupancy",
        (
            Panel(
                "Occupancy per replica",
                "timeseries",
                "percentunit",
                (Target(OCCUPANCY, PER_REPLICA),),
                "live slots / slots, averaged over the replica's engine steps in the window",
            ),
            Panel(
                "Occupancy heatmap",
                "heatmap",
                "percentunit",
                (Target(OCCUPANCY, PER_REPLICA),),
                "the same occupancy, one row per replica",
            ),
            Panel(
                "Slots in use now",
                "bargauge",
                "percentunit",
                (Target(f"{now('slots_used')} / {now('slots_total')}", PER_REPLICA),),
            ),
        ),
    ),
    Row(
        "Queues and K/V cache",
        (
            Panel("Queue depth", "timeseries", "short", (Target(now("num_requests_waiting"), PER_REPLICA),)),
            Panel("Running requests", "timeseries", "short", (Target(now("num_requests_running"), PER_REPLICA),)),
            Panel(
                "K/V cache usage",
                "timeseries",
                "percentunit",
                (
                    Target(now("kv_cache_usage_perc"), "{{replica}} reserved"),
                    Target(f"{now('kv_tokens_used')} / {now('kv_tokens_total')}", "{{replica}} computed"),
                ),
                "share of the K/V budget reserved (slot rows or blocks) and holding computed tokens",
            ),
        ),
    ),
    Row(
        "Throughput",
        (
            Panel(
                "Output tokens/s per replica",
                "timeseries",
                "short",
                (Target(rate("generation_tokens_total", by="replica"), PER_REPLICA),),
            ),
            Panel(
                "Tokens/s, cluster",
                "timeseries",
                "short",
                (
                    Target(rate("generation_tokens_total"), "output"),
                    Target(rate("prefill_tokens_total"), "prefill"),
                ),
            ),
            Panel(
                "Step time per replica",
                "timeseries",
                "s",
                (
                    Target(quantile(0.5, "step_time_seconds", by="replica"), "{{replica}} p50"),
                    Target(quantile(0.99, "step_time_seconds", by="replica"), "{{replica}} p99"),
                ),
            ),
        ),
    ),
    Row(
        "Latency (replica-side)",
        (
            Panel("TTFT", "timeseries", "s", p50_p99("time_to_first_token_seconds")),
            Panel("ITL", "timeseries", "s", p50_p99("inter_token_latency_seconds")),
            Panel("TPOT", "timeseries", "s", p50_p99("request_time_per_output_token_seconds")),
            Panel("E2E latency", "timeseries", "s", p50_p99("e2e_request_latency_seconds")),
            Panel("Queue time", "timeseries", "s", p50_p99("request_queue_time_seconds")),
        ),
    ),
    Row(
        "Goodput and outcomes",
        (
            Panel(
                "Goodput (output tokens/s of requests meeting the SLO)",
                "timeseries",
                "short",
                (
                    Target(rate("slo_tokens_total", by="replica", slo="met"), PER_REPLICA),
                    Target(rate("slo_tokens_total", slo="met"), "cluster"),
                ),
            ),
            Panel(
                "SLO attainment",
                "timeseries",
                "percentunit",
                (
                    Target(
                        f"{rate('slo_requests_total', by='replica', slo='met')} / "
                        f"{rate('slo_requests_total', by='replica')}",
                        PER_REPLICA,
                    ),
                    Target(f"{rate('slo_requests_total', slo='met')} / {rate('slo_requests_total')}", "cluster"),
                ),
                "share of ended requests that met the SLO the cluster was started with",
            ),
            Panel(
                "Requests ended, by reason",
                "timeseries",
                "reqps",
                (Target(rate("requests_finished_total", by="finished_reason"), "{{finished_reason}}"),),
            ),
            Panel(
                "Preemptions per replica",
                "timeseries",
                "short",
                (Target(rate("num_preemptions_total", by="replica"), PER_REPLICA),),
            ),
            Panel(
                "Prefix cache hit rate",
                "timeseries",
                "percentunit",
                (Target(f"{rate('prefix_cache_hits_total')} / {rate('prompt_tokens_total')}", "hits / prompt tokens"),),
            ),
        ),
    ),
    Row(
        "Router",
        (
            Panel(
                "Dispatch share per replica",
                "timeseries",
                "percentunit",
                (
                    Target(
                        f"{rate('router_dispatches_total', by='replica')} / scalar({rate('router_dispatches_total')})",
                        PER_REPLICA,
                    ),
                ),
            ),
            Panel(
                "Routing decision time and signal age",
                "timeseries",
                "s",
                (
                    Target(quantile(0.99, "router_decision_time_seconds"), "decision p99"),
                    Target(quantile(0.99, "router_signal_age_seconds"), "signal age p99"),
                ),
            ),
            Panel(
                "Router rejections",
                "timeseries",
                "reqps",
                (Target(rate("router_rejections_total", by="routing_policy"), "{{routing_policy}}"),),
            ),
        ),
    ),
    Row(
        "Flow control",
        (
            Panel(
                "Requests held by priority band",
                "timeseries",
                "short",
                (Target(f"max by (priority) ({select('router_flow_held')})", "band {{priority}}"),),
                "requests the router holds for dispatch while every replica is saturated (lower bands go "
                "first); zero without a flow-control config's holding policy",
            ),
            Panel(
                "Flow control by tenant",
                "timeseries",
                "reqps",
                (Target(rate("router_flow_requests_total", by="tenant, outcome"), "{{tenant}} {{outcome}}"),),
                "each tenant's requests per second by their way through flow control: dispatched at once, held, "
                "released from hold, refused (a limit, a deadline, shed)",
            ),
        ),
    ),
    Row(
        "Autoscaling",
        (
            Panel(
                "Replicas by state",
                "timeseries",
                "short",
                (Target(f"max by (state) ({select('autoscaler_replicas')})", "{{state}}"),),
                "replicas the autoscaling controller holds: starting (asked for, not yet routed to), "
                "serving, draining (routed nothing new, leaving once done)",
            ),
            Panel(
                "Scaling decisions by direction",
                "timeseries",
                "short",
                (Target(rate("autoscaler_decisions_total", by="direction"), "{{direction}}"),),
                "decisions per second that scaled up, down or held (every decision period makes one); "
                "each one's reason and inputs are in the store's scaling table and `slotserve status`",
            ),
        ),
    ),
)
