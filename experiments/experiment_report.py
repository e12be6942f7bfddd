"""What an experiment prints and writes: one table row per cell without its seed (the median
over seeds, with the spread as half the min-max range), and a Markdown report with the table,
the command, the machine, the run ids and the plots, in one folder.

Every figure comes from `metrics.goodput_report.analyze` of the stored runs (the docs/ARCHITECTURE.md metrics,
for the whole cluster), so the report says what `slotserve report RUN` says about each run.

Where requests come in several classes (priority bands, tenants), the report splits each row
by them (`experiments.flow_report`). Where cells size their cluster differently
(`sweep.autoscale`, `[cluster] autoscale`), rows also give what the cluster cost, and the best
autoscaling policy is set against static provisioning (`experiments.scaling_report`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.serve_baseline import SERVE_ROUTERS
from experiments.flow_report import by_class
from experiments.plan import AXES, Cell
from experiments.pools_report import against_colocated
from experiments.report_plots import SPREAD_NOTE, plot_rows
from experiments.run import ExperimentResult
from experiments.scaling_report import SCALING_METRICS, against_static, plot_scaling_timeline, scaling_figures
from metrics.definitions import SLO
from metrics.goodput_report import analyze
from metrics.store import MetricsStore
from protocol.handover import PREFILL_HANDOVER
from workloads.prefixes import best_prefix_hit_rate

# key, header, value from analyze()'s cluster scope (with the run-wide prefix hit rate, imbalance, regret), format
METRICS: list[tuple[str, str, Callable[[dict], float | None], str]] = [
    ("throughput", "tok/s", lambda c: c["throughput"], "{:.1f}"),
    ("goodput", "good tok/s", lambda c: c["goodput"], "{:.1f}"),
    ("slo_attainment", "SLO met %", lambda c: _pct(c["slo_attainment"]), "{:.0f}"),
    ("ttft_p50", "TTFT p50 s", lambda c: c["ttft"]["p50"], "{:.3f}"),
    ("ttft_p90", "TTFT p90 s", lambda c: c["ttft"]["p90"], "{:.3f}"),
    ("ttft_p99", "TTFT p99 s", lambda c: c["ttft"]["p99"], "{:.3f}"),
    ("tpot_p50", "TPOT p50 s", lambda c: c["tpot"]["p50"], "{:.3f}"),
    ("tpot_p99", "TPOT p99 s", lambda c: c["tpot"]["p99"], "{:.3f}"),
    ("itl_p99", "ITL p99 s", lambda c: c["itl"]["p99"], "{:.3f}"),
    ("slot_efficiency", "slot eff %", lambda c: _pct(c["slot_efficiency"]), "{:.1f}"),
    ("prefix_hit_rate", "prefix hit %", lambda c: _pct(c["prefix_hit_rate"]), "{:.1f}"),
    ("imbalance", "imbalance", lambda c: c["imbalance"]["output_tokens"], "{:.2f}"),
    ("regret", "regret s", lambda c: c["regret"]["mean"], "{:.3f}"),
    ("ttft_mape", "TTFT pred MAPE %", lambda c: _pct(c["ttft_prediction"]["mape"]), "{:.1f}"),
    ("index_staleness", "index stale %", lambda c: _pct(c["index_staleness"]["staleness"]), "{:.1f}"),
    ("transfer", "hand-over s", lambda c: c["transfer"], "{:.4f}"),
]
# shown only where a row has figures for the key they map to: where a policy of the table predicts
# TTFT, or believes what the replicas' caches hold, or where a cell hands requests over with their
# K/V (prefill/decode pools; the TPOT tail is what a prompt's prefill does to the decodes beside it)
SHOWN_WHERE = {k: k for k in ("ttft_mape", "index_staleness", "transfer")} | {"tpot_p99": "transfer"}


def _pct(v: float | None) -> float | None:
    return None if v is None else 100 * v


def transfer_seconds(store: MetricsStore, run_id: int) -> float | None:
    """A run's mean hand-over time, from its prefill replicas' K/V to the decode replicas (None:
    none was handed over). A simulated run states its link's price per hand-over in its config
    (`sim.disaggregation.transfer_summary`); a cluster's run measured each fetch (the store's
    migrations, `kv_seconds`, of those a prefill replica handed over: a drained replica's
    moves with their K/V are not prefill-to-decode transfers)."""
    config = store.run(run_id)["config"] or {}
    if "handovers" in config:
        return config["handover_seconds_mean"] if config["handovers"] else None
    fetches = [
        m["kv_seconds"]
        for m in store.migrations(run_id)
        if m["kv_seconds"] is not None and (m["reason"] or "").startswith(PREFILL_HANDOVER)
    ]
    return sum(fetches) / len(fetches) if fetches else None


@dataclass
class SummaryRow:
    """A cell without its seed: its runs (one per seed) and each metric's value per run."""

    cell: Cell  # the first seed's
    run_ids: list[int] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=list)  # each run's, in `run_ids`' order

    def per_seed(self, key: str) -> dict[int, float]:
        """A figure every run has (goodput, SLO attainment) by seed: two rows are set against
        each other on the seeds both ran, the same traffic."""
        return dict(zip(self.seeds, self.values[key], strict=True))

    def cell_text(self, key: str) -> str:
        values = self.values[key]
        if not values:
            return "-"
        fmt = next(f for k, *_, f in [*METRICS, *SCALING_METRICS] if k == key)
        text = fmt.format(statistics.median(values))
        return text if len(values) < 2 else f"{text} ±{fmt.format((max(values) - min(values)) / 2)}"


def summarize_runs(result: ExperimentResult) -> list[SummaryRow]:
    """The table's rows, in the order the cells ran."""
    plan = result.plan
    slo = SLO(**plan.experiment.slo.model_dump())
    sized = any(s is not None for s in plan.scalings.values())
    keys = [k for k, *_ in METRICS] + ([k for k, *_ in SCALING_METRICS] if sized else [])
    store = MetricsStore(result.store_path)
    rows: dict[tuple, SummaryRow] = {}
    try:
        for cell, run_id in result.runs:
            row = rows.setdefault(cell.row, SummaryRow(cell, values={k: [] for k in keys}))
            row.run_ids.append(run_id)
            row.seeds.append(cell.seed)
            a = analyze(store, run_id, slo)
            kept = ("prefix_hit_rate", "imbalance", "regret", "ttft_prediction", "index_staleness")
            scope = {**a["cluster"], **{k: a[k] for k in kept}, "transfer": transfer_seconds(store, run_id)}
            for key, _, value, _ in METRICS:
                if (v := value(scope)) is not None:
                    row.values[key].append(v)
            if sized:
                for key, v in scaling_figures(store, run_id, a["cluster"]).items():
                    if v is not None:
                        row.values[key].append(v)
    finally:
        store.close()
    return list(rows.values())


def shown_axes(rows: list[SummaryRow]) -> list[str]:
    """Batching and routing always; another axis only where it takes more than one value."""
    return [a for a in AXES if a in ("batching", "routing") or len({getattr(r.cell, a) for r in rows}) > 1]


def _key_text(row: SummaryRow, axis: str) -> str:
    value = getattr(row.cell, axis)
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def format_summary(rows: list[SummaryRow], markdown: bool = False) -> str:
    axes = shown_axes(rows)
    metrics = [(k, h) for k, h, *_ in METRICS if k not in SHOWN_WHERE or any(r.values[SHOWN_WHERE[k]] for r in rows)]
    metrics += [(k, h) for k, h, _ in SCALING_METRICS if k in rows[0].values]
    header = axes + [h for _, h in metrics]
    body = [[_key_text(r, a) for a in axes] + [r.cell_text(k) for k, _ in metrics] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(axes) + "---:|" * len(metrics)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
    else:
        widths = [max(len(x) for x in column) for column in zip(header, *body)]
        lines = [
            "  ".join(f"{x:<{w}}" if i < len(axes) else f"{x:>{w}}" for i, (x, w) in enumerate(zip(cells, widths)))
            for cells in [header, *body]
        ]
    seeds = max(len(r.run_ids) for r in rows)
    return "\n".join(lines + ["", f"{SPREAD_NOTE} ({seeds} seeds)" if seeds > 1 else "one seed: no spread"])


SERVE_DEFAULT = "serve_power_of_two"


def against_serve(rows: list[SummaryRow]) -> list[str]:
    """Where Ray Serve's default router ran: per point of the sweep, slotserve's best policy on
    goodput (median over seeds) and its ratio to Serve's default router and to each other Serve
    router there. Empty when no Serve router ran."""
    groups: dict[tuple, dict[str, SummaryRow]] = {}
    for r in rows:
        key = tuple(getattr(r.cell, a) for a in AXES if a != "routing")
        groups.setdefault(key, {})[r.cell.routing] = r
    lines = []
    for by_policy in groups.values():
        ours = {p: r for p, r in by_policy.items() if p not in SERVE_ROUTERS and r.values["goodput"]}
        serve = {p: r for p, r in by_policy.items() if p in SERVE_ROUTERS and r.values["goodput"]}
        if SERVE_DEFAULT not in serve or not ours:
            continue
        good = {p: statistics.median(r.values["goodput"]) for p, r in {**ours, **serve}.items()}
        best = max(ours, key=good.get)
        cell = by_policy[best].cell
        where = " ".join(f"{a}={_key_text(by_policy[best], a)}" for a in shown_axes(rows) if a != "routing")
        ratios = ", ".join(f"{good[best] / good[p]:.2f}x {p} ({good[p]:.1f})" if good[p] else f"{p} 0" for p in serve)
        lines.append(f"{where or cell.label}: best slotserve {best} {good[best]:.1f} good tok/s = {ratios}")
    return lines


def prefix_ceilings(result: ExperimentResult, rows: list[SummaryRow]) -> list[str]:
    """Per workload whose prompts share blocks, on replicas with prefix caching: the best
    possible prefix hit rate (`best_prefix_hit_rate`: every request sent where its longest
    cached prefix lives and nothing evicted; median over seeds) and each policy's measured
    rate (median over its runs, every load) as a share of it, best first."""
    plan, lines = result.plan, []
    if result.vocab_size is None:
        return lines
    for name in dict.fromkeys(r.cell.workload for r in rows):
        cells = {c.seed: c for c, _ in result.runs if c.workload == name}
        engine = plan.engine_config(next(iter(cells.values())))
        workloads = {s: plan.workload(c, result.capacities[c.slots]) for s, c in cells.items()}
        if not engine.prefix_caching or not any(q.blocks for w in workloads.values() for q in w.requests):
            continue
        best = statistics.median(
            best_prefix_hit_rate(w, seed, result.vocab_size, engine.block_size) for seed, w in workloads.items()
        )
        hits: dict[str, list[float]] = {}
        for r in rows:
            if r.cell.workload == name:
                hits.setdefault(r.cell.routing, []).extend(v / 100 for v in r.values["prefix_hit_rate"])
        measured = sorted(((statistics.median(v), p) for p, v in hits.items() if v), reverse=True)
        policies = ", ".join(f"{p} {100 * h:.1f}% ({h / best:.2f}x)" for h, p in measured) if best else "-"
        title = name or next(iter(workloads.values())).name
        lines.append(f"{title}: best possible prefix hit {100 * best:.1f}%; {policies}")
    return lines


def machine_line(machine: dict) -> str:
    cpu = f"{machine['cpu']} (flags: {machine['cpu_flags']})" if "cpu" in machine else machine.get("processor")
    parts = [machine.get("hostname"), machine.get("platform"), cpu]
    parts += [
        f"{machine['cpus_usable']} usable CPUs" if "cpus_usable" in machine else None,
        f"{machine['memory_gib']} GiB" if "memory_gib" in machine else None,
        ", ".join(machine.get("gpus", [])) or "no GPU",
    ]
    return ", ".join(str(p) for p in parts if p)


def write_report(result: ExperimentResult, rows: list[SummaryRow], out: Path, command: str) -> Path:
    """`out`/report.md with the table, the command, the machine, the runs and the plots (PNGs in `out`)."""
    experiment = result.plan.experiment
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_rows(result, rows, shown_axes(rows), out) + plot_scaling_timeline(result, rows, out)
    store = MetricsStore(result.store_path)
    try:
        first = store.run(result.runs[0][1])
        today = time.strftime("%Y-%m-%d")
        if result.collected:  # runs made apart, maybe at several commits
            commits = ", ".join(f"`{c}`" for c in dict.fromkeys(store.run(r)["git_commit"] for _, r in result.runs))
            made = f"Written by `{command}` on {today} from the runs the store holds, made at commit {commits}."
        else:
            made = f"Made by `{command}` on {today}, commit `{first['git_commit']}`."
    finally:
        store.close()
    c, slo = experiment.cluster, experiment.slo
    serve, ceilings, static = against_serve(rows), prefix_ceilings(result, rows), against_static(result, rows)
    colocated, classes = against_colocated(result, rows), by_class(result, rows)
    if c.model != "fake":
        model = c.model
    elif c.fake_step_seconds is not None:
        model = f"fake flat-cost model ({c.fake_step_seconds * 1000:g} ms a step)"
    else:
        scale = f" x {c.cost_scale:g}" if c.cost_scales is None else ""  # else per replica, below
        model = f"fake model, each step priced by {c.cost_model}{scale} on the wall clock"
    if result.simulated:
        cost = result.plan.cost
        model = f"simulated: {type(cost).__name__}" + (
            f" from {c.cost_model}" if c.cost_model else f" ({c.fake_step_seconds * 1000:g} ms a step)"
        )
        if c.step_overhead or c.dispatch_delay:
            model += f", plus {c.step_overhead * 1000:g} ms of serving loop a step"
            model += f" and {c.dispatch_delay * 1000:g} ms from arrival to replica"
        if c.submit_interval:
            model += f", requests due together sent {c.submit_interval * 1000:g} ms apart"
    if c.cost_scales is not None:
        model += f", replicas' step times x {', '.join(f'{x:g}' for x in c.cost_scales)} (each its own)"
    sizing = ""
    if any(s is not None for s in result.plan.scalings.values()):
        sizing = " (capacity measured on them; each cell sized as its scaling says"
        sizing += f", a simulated cold start {result.plan.cold_start_s:g} s)" if result.simulated else ")"
    capacity = ", ".join(
        f"{v.decode_tokens_per_s:.1f} output tok/s and {v.prefill_tokens_per_s:.1f} prompt tok/s at {s} slots/replica"
        for s, v in result.capacities.items()
    )
    lines = [
        f"# {experiment.name}",
        "",
        experiment.description.strip(),
        "",
        made,
        "",
        f"- Machine: {machine_line(first['machine'] or {})}",
        f"- Cluster: {c.replicas} replicas{sizing}, {model}, max_seq_len {c.max_seq_len}, {c.dtype}"
        f"{'' if result.simulated else f', {c.num_cpus:g} CPU per replica'}",
        f"- Workload of the first cell: {first['config']['workload']}; seeds {experiment.sweep.seeds}"
        f"{'; each cell sets the arrival rate from its load' if experiment.sweep.load else ''}",
        f"- Capacity (saturating probe, {'simulated' if result.simulated else 'median of 3'}): {capacity}"
        if result.capacities
        else "- Capacity: not measured",
        f"- SLO: TTFT <= {slo.ttft} s, TPOT <= {slo.tpot} s, E2E {f'<= {slo.e2e} s' if slo.e2e else 'not limited'}; "
        "rejected and failed requests miss it",
        f"- Runs: {len(result.runs)} in `{result.store_path}` ({'simulated' if result.simulated else 'real'})",
        "",
        "## Results",
        "",
        format_summary(rows, markdown=True),
        "",
        *(["## Against Ray Serve's routers", "", *[f"- {line}" for line in serve], ""] if serve else []),
        *(["## Autoscaling against static provisioning", "", *[f"- {x}" for x in static], ""] if static else []),
        *(["## Prefix cache against the best possible", "", *[f"- {x}" for x in ceilings], ""] if ceilings else []),
        *(["## Colocated against disaggregated", "", *[f"- {x}" for x in colocated], ""] if colocated else []),
        *(["## By class and tenant", "", *classes, ""] if classes else []),
        "## Runs",
        "",
        "| row | run ids |",
        "|---|---|",
        *[f"| {r.cell.label.rsplit(' seed=', 1)[0]} | {', '.join(map(str, r.run_ids))} |" for r in rows],
        "",
    ]
    if plots:
        lines += ["## Plots", ""] + [f"### {title}\n\n![{title}]({path.name})\n" for title, path in plots]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
