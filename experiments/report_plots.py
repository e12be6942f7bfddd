"""The plots of an experiment's report (`experiments.experiment_report`): throughput and
goodput, TTFT and ITL p99 against load, the latency CDFs, per-replica occupancy and a slot
timeline, each row a series named by the axes the table shows."""

from __future__ import annotations

from pathlib import Path

from experiments.plan import Cell
from experiments.run import ExperimentResult
from experiments.scaling_report import Row
from metrics.store import MetricsStore

SPREAD_NOTE = "median over seeds ± half the min–max range"
# the plots of figures against load: name -> (title, its panels as (figure, axis label))
SWEEPS = {
    "throughput": (
        "Throughput and goodput",
        [("throughput", "throughput (output tok/s)"), ("goodput", "goodput (output tok/s)")],
    ),
    "latency": ("TTFT and ITL p99", [("ttft_p99", "TTFT p99 (s)"), ("itl_p99", "ITL p99 (s)")]),
}


def series_label(cell: Cell, axes: list[str]) -> str:
    """A row's name in plots: its shown axes but the load."""
    return " ".join(str(getattr(cell, a)) for a in axes if a != "load" and getattr(cell, a) is not None)


def plot_rows(result: ExperimentResult, rows: list[Row], axes: list[str], out: Path) -> list[tuple[str, Path]]:
    """The plots the experiment file asks for (`plots`), each a PNG in `out`, with its title;
    `axes`: the axes the table shows, which name the series."""
    from metrics import plots

    experiment = result.plan.experiment
    store = MetricsStore(result.store_path)
    made: list[tuple[str, Path]] = []
    kind = "simulated" if result.simulated else "real"
    points = [plots.SweepPoint(series_label(r.cell, axes), r.cell.load, r.values) for r in rows]
    series_colors = plots.colors(p.series for p in points)
    first_runs = {_run_title(r, axes): r.run_ids[0] for r in rows}  # every row: a plot leaves none out
    lightest: dict[str, Row] = {}  # per series, its row at the lowest load: every policy gets a timeline
    for r in rows:
        best = lightest.setdefault(series_label(r.cell, axes), r)
        if (r.cell.load or 0) < (best.cell.load or 0):
            lightest[series_label(r.cell, axes)] = r
    timelines = {_run_title(r, axes): r.run_ids[0] for r in lightest.values()}
    try:
        for name in experiment.plots:
            path = out / f"{name}.png"
            if name in SWEEPS:  # figures against load, a panel per metric
                title, panels = SWEEPS[name]
                subtitle = f"{experiment.name} ({kind}): {SPREAD_NOTE}"
                made.append((title, plots.plot_sweep(points, panels, path, subtitle, series_colors)))
            elif name == "cdf":
                traces = {_row_title(r, axes): [t for run_id in r.run_ids for t in store.traces(run_id)] for r in rows}
                made.append(
                    (
                        "Latency distributions",
                        plots.plot_latency_cdfs(
                            traces,
                            path,
                            f"{experiment.name} ({kind}): all seeds pooled; a series' colour darker at higher load",
                            row_colors(rows, axes, series_colors),
                        ),
                    )
                )
            elif name == "occupancy":
                made.append(
                    (
                        "Per-replica occupancy",
                        plots.plot_occupancy(
                            {label: store.steps(run_id) for label, run_id in first_runs.items()},
                            path,
                            f"{experiment.name} ({kind}): occupancy per replica, first seed's run",
                        ),
                    )
                )
            elif name == "slot_timeline":
                made.append(
                    (
                        "Slot timeline",
                        plots.plot_slot_timelines(
                            {label: _timeline(store, run_id) for label, run_id in timelines.items()}, path
                        ),
                    )
                )
    finally:
        store.close()
    return made


TIMELINE_REQUESTS = 32  # a slot timeline shows the first requests of one replica: a short run


def row_colors(rows: list[Row], axes: list[str], series_colors: dict) -> dict[str, tuple]:
    """Each row's colour: its series' colour (as in the figures against load), lighter at a
    lower load, so a series reads as one family of lines."""
    from metrics.plots import shades

    loads: dict[str, list[Row]] = {}
    for r in rows:
        loads.setdefault(series_label(r.cell, axes), []).append(r)
    colored = {}
    for series, mine in loads.items():
        mine.sort(key=lambda r: r.cell.load or 0)
        for r, shade in zip(mine, shades(series_colors[series], len(mine))):
            colored[_row_title(r, axes)] = shade
    return colored


def _row_title(row: Row, axes: list[str]) -> str:
    return series_label(row.cell, axes) + (f" load {row.cell.load:g}" if row.cell.load is not None else "")


def _run_title(row: Row, axes: list[str]) -> str:
    return f"{_row_title(row, axes)} (run {row.run_ids[0]})"


def _timeline(store: MetricsStore, run_id: int) -> tuple[list, int]:
    from metrics.plots import slot_spans

    steps = store.steps(run_id)
    if not steps:
        return [], 1
    replica = min(s["replica_id"] for s in steps)
    mine = [s for s in steps if s["replica_id"] == replica]
    traces = [t for t in store.traces(run_id) if t.replica == replica]
    return slot_spans(traces, mine)[:TIMELINE_REQUESTS], mine[0]["num_slots"]
