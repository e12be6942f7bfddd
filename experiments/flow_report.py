"""What flow control did for each request class: per row of the table (a cell without its
seed), per priority band and per tenant, TTFT and TPOT percentiles, goodput, share of service
and requests shed, each the median over the row's seeds.

Goodput is the group's output tokens of requests that met the SLO over the whole run's
makespan (not the group's own), so the groups of one run add up to its goodput. Share of
service is the group's share of the run's served tokens weighted as VTC weighs them (a prompt
token 1, an output token 2: `protocol.flow.FlowConfig`'s defaults), whatever policy ran, so
fcfs and vtc are judged by the same measure; over a whole run where every request is served it
is the same under every policy, so it is also given over the stretch in which every tenant is
sending (from the last tenant's first arrival to the first tenant's last one: a flood's stretch),
each token counted when it was made (a prompt with its first token). Shed counts requests that
ended `rejected`."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from experiments.run import ExperimentResult
from experiments.scaling_report import Row
from metrics.definitions import SLO, RequestTrace, percentiles
from metrics.store import MetricsStore
from protocol import defaults
from protocol.flow import FlowConfig

_WEIGHTS = FlowConfig()
FIGURES: list[tuple[str, str]] = [
    ("requests", "{:.0f}"),
    ("TTFT p50 s", "{:.3f}"),
    ("TTFT p90 s", "{:.3f}"),
    ("TTFT p99 s", "{:.3f}"),
    ("TPOT p50 s", "{:.3f}"),
    ("TPOT p90 s", "{:.3f}"),
    ("TPOT p99 s", "{:.3f}"),
    ("good tok/s", "{:.1f}"),
    ("service %", "{:.1f}"),
    ("service % all sending", "{:.1f}"),
    ("shed", "{:.0f}"),
]


def _service(trace: RequestTrace) -> float:
    if not trace.token_times:
        return 0.0
    return _WEIGHTS.prompt_weight * trace.prompt_len + _WEIGHTS.output_weight * trace.num_output_tokens


def _all_sending(traces: list[RequestTrace]) -> tuple[float, float]:
    """From the last tenant's first arrival to the first tenant's last arrival."""
    spans: dict[str, list[float]] = {}
    for t in traces:
        span = spans.setdefault(t.tenant, [t.arrival, t.arrival])
        span[0], span[1] = min(span[0], t.arrival), max(span[1], t.arrival)
    return max(s[0] for s in spans.values()), min(s[1] for s in spans.values())


def _service_within(trace: RequestTrace, start: float, end: float) -> float:
    times = trace.token_times
    prompt = _WEIGHTS.prompt_weight * trace.prompt_len if times and start <= times[0] <= end else 0.0
    return prompt + _WEIGHTS.output_weight * sum(start <= t <= end for t in times)


def group_figures(traces: list[RequestTrace], slo: SLO) -> dict[str, dict[str, float | None]]:
    """One run's figures by group ("priority P", "tenant T"), groups in first-seen order."""
    start = min(t.arrival for t in traces)
    makespan = max(max(t.finish_time for t in traces) - start, 1e-9)
    total = sum(_service(t) for t in traces) or 1.0
    both = _all_sending(traces)
    total_within = sum(_service_within(t, *both) for t in traces)
    groups: dict[str, list[RequestTrace]] = {}
    for keyed in (lambda t: f"priority {t.priority}", lambda t: f"tenant {t.tenant}"):
        for trace in sorted(traces, key=lambda t: t.arrival):
            groups.setdefault(keyed(trace), []).append(trace)
    figures = {}
    for name, group in groups.items():
        ttft = percentiles(t.ttft for t in group if t.ttft is not None)
        tpot = percentiles(t.tpot for t in group if t.tpot is not None)
        figures[name] = {
            "requests": len(group),
            **{f"TTFT {p} s": ttft[p] for p in ("p50", "p90", "p99")},
            **{f"TPOT {p} s": tpot[p] for p in ("p50", "p90", "p99")},
            "good tok/s": sum(t.num_output_tokens for t in group if slo.met_by(t)) / makespan,
            "service %": 100 * sum(_service(t) for t in group) / total,
            "service % all sending": 100 * sum(_service_within(t, *both) for t in group) / total_within
            if total_within
            else None,
            "shed": sum(t.finish_reason == "rejected" for t in group),
        }
    return figures


def has_classes(traces: list[RequestTrace]) -> bool:
    """Whether a run's requests come in more than the default class."""
    return any((t.priority, t.tenant) != (defaults.PRIORITY, defaults.TENANT) for t in traces)


def by_class(result: ExperimentResult, rows: list[Row]) -> list[str]:
    """A Markdown table: per row and group, each figure's median over the row's seeds. Empty
    when every request of every run is of the default class."""
    slo = SLO(**result.plan.experiment.slo.model_dump())
    store = MetricsStore(result.store_path)
    try:
        runs = {r: store.traces(r) for row in rows for r in row.run_ids}
    finally:
        store.close()
    if not any(has_classes(traces) for traces in runs.values()):
        return []
    lines = [
        "| row | group | " + " | ".join(name for name, _ in FIGURES) + " |",
        "|---|---|" + "---:|" * len(FIGURES),
    ]
    for row in rows:
        per_run = [group_figures(runs[r], slo) for r in row.run_ids if runs[r]]
        label = row.cell.label.rsplit(" seed=", 1)[0]
        for group in dict.fromkeys(g for figures in per_run for g in figures):
            cells = [_median(per_run, group, name, fmt.format) for name, fmt in FIGURES]
            lines.append(f"| {label} | {group} | " + " | ".join(cells) + " |")
    return lines


def _median(per_run: list[dict], group: str, name: str, fmt: Callable[[float], str]) -> str:
    values = [f[group][name] for f in per_run if group in f and f[group][name] is not None]
    return fmt(statistics.median(values)) if values else "-"
