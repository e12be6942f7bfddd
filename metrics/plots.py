"""Plots shared by the comparison, cluster and experiment commands (matplotlib, written to PNG).

Every figure follows the same rules, so a reader learns them once: one colour per series (a
policy, a row of an experiment), given by `colors` and the same in every panel of a figure; one
legend for the whole figure, below its panels (`figure_legend`), so no legend covers data; the
spread over seeds drawn, never hidden in a mean."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from metrics.definitions import SLO, RequestTrace  # noqa: E402


def colors(names: Iterable[str]) -> dict[str, tuple]:
    """One colour per name, in the order given (tab10, tab20 past ten names): every panel and
    figure drawn from one list of names gives a name the same colour."""
    names = list(dict.fromkeys(names))
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def shades(color, n: int) -> list[tuple]:
    """n shades of `color`, light to full (one: the colour itself): the rows of one series at
    rising loads."""
    rgb = np.array(matplotlib.colors.to_rgb(color))
    return [tuple(1 - (1 - rgb) * depth) for depth in (np.linspace(0.35, 1, n) if n > 1 else [1.0])]


def figure_legend(fig, handles: dict[str, object]) -> None:
    """One legend for the figure, below its panels (the figure's constrained layout makes room
    for it there; above them it would meet the suptitle), so it covers none of their data; as
    many columns as fit its width."""
    longest = max((len(label) for label in handles), default=1)
    fit = int(fig.get_figwidth() * 72 // (longest * 5 + 40))  # 8-point text: about 5 points a character
    fig.legend(
        list(handles.values()),
        list(handles),
        loc="outside lower center",
        ncol=max(1, min(len(handles), fit)),
        fontsize=8,
        frameon=False,
    )


def line_handles(named_colors: dict[str, tuple]) -> dict[str, Line2D]:
    return {name: Line2D([], [], color=c, linewidth=2) for name, c in named_colors.items()}


def _figure(rows: int, cols: int, width: float, height: float):
    """Panels on a constrained layout, which keeps the suptitle and `figure_legend` clear of them."""
    return plt.subplots(rows, cols, figsize=(width, height), squeeze=False, layout="constrained")


def _cdf(ax, values: Sequence[float], **line) -> None:
    values = sorted(values)
    if values:
        ax.plot(values, np.arange(1, len(values) + 1) / len(values), **line)


def latency_cdfs(ax_ttft, ax_itl, named: dict[str, list[Sequence[RequestTrace]]], named_colors: dict) -> None:
    """TTFT and pooled inter-token-latency distributions: per name, one line per group of its
    traces (a seed's run, or all of them pooled), all in the name's colour, thin where several
    groups share it so their spread shows as a bundle."""
    for name, groups in named.items():
        width = 1.6 if len(groups) == 1 else 0.9
        for traces in groups:
            _cdf(ax_ttft, [t.ttft for t in traces if t.ttft is not None], color=named_colors[name], linewidth=width)
            _cdf(ax_itl, [g for t in traces for g in t.itls], color=named_colors[name], linewidth=width)
    ax_ttft.set_xlabel("TTFT (s)")
    ax_itl.set_xlabel("inter-token latency (s)")
    ax_itl.set_xscale("log")
    for ax in (ax_ttft, ax_itl):
        ax.set_ylabel("share of requests" if ax is ax_ttft else "share of token gaps")
        ax.set_ylim(0, 1.02)


# --- `slotserve run`: the policies compared ---------------------------------------------------


def plot_cluster_runs(store, by_policy: dict[str, list[dict]], slo: SLO, path: Path) -> Path:
    """`cluster_runs_figure` as a PNG at `path`."""
    return _save(cluster_runs_figure(store, by_policy, slo), path)


def cluster_runs_figure(store, by_policy: dict[str, list[dict]], slo: SLO):
    """The routing comparison of `slotserve run` in one picture, a colour per policy: goodput
    per policy (the bar its median over rounds, the error bar min to max, a dot per seed; the
    title the winner's lead as `metrics.verdict` reads it), the TTFT and ITL distributions (a
    thin line per seed) and occupancy over the run (the median over the policy's replicas and
    seeds, with their 10-90% band). `by_policy`: `metrics.goodput_report.analyze_by_policy` of
    the runs at `slo`."""
    from metrics.verdict import GOODPUT, lead, rounds

    named_colors = colors(by_policy)
    fig, grid = _figure(2, 2, 13, 8.5)
    (ax_goodput, ax_occupancy), (ax_ttft, ax_itl) = grid
    _goodput_bars(ax_goodput, {p: [GOODPUT(a) for a in runs] for p, runs in by_policy.items()}, named_colors)
    if len(by_policy) > 1:
        won = lead(by_policy, GOODPUT, True)
        how = "within noise" if won.reached else f"holds over {rounds(by_policy)}"
        ratio = f"{won.ratio:.2f}x {won.second}'s goodput" if np.isfinite(won.ratio) else f"goodput, {won.second} none"
        ax_goodput.set_title(f"{won.first} {ratio} ({how})", fontsize=11)
    runs_of = {p: [a["run_id"] for a in runs] for p, runs in by_policy.items()}
    latency_cdfs(ax_ttft, ax_itl, {p: [store.traces(r) for r in ids] for p, ids in runs_of.items()}, named_colors)
    ax_ttft.axvline(slo.ttft, color="0.4", linestyle="--", linewidth=1, label="TTFT SLO")
    ax_ttft.annotate(f" SLO {slo.ttft:g} s", (slo.ttft, 0.02), fontsize=8, color="0.3")
    ax_ttft.set_title("TTFT, a line per seed", fontsize=9)
    ax_itl.set_title("inter-token latency, a line per seed", fontsize=9)
    for policy, ids in runs_of.items():
        curves = [c for r in ids for c in occupancy_curves(store.steps(r))]
        _band(ax_occupancy, curves, named_colors[policy])
    ax_occupancy.set_title("occupancy: median over replicas and seeds, 10-90% band", fontsize=9)
    ax_occupancy.set_xlabel("time in run (share of the run)")
    ax_occupancy.set_ylabel("live slots / slots")
    ax_occupancy.set_ylim(0, 1.02)
    figure_legend(fig, line_handles(named_colors))
    first_run = store.run(min(r for ids in runs_of.values() for r in ids))
    fig.suptitle(
        f"{_workload(first_run)}: goodput counts the output tokens of requests with "
        f"TTFT <= {slo.ttft:g} s and TPOT <= {slo.tpot:g} s",
        fontsize=10,
    )
    return fig


def _goodput_bars(ax, values: dict[str, list[float]], named_colors: dict) -> None:
    """A bar per name at its median, an error bar from min to max, a dot per value (per seed)."""
    for i, (name, vs) in enumerate(values.items()):
        v = np.array(vs, dtype=float)
        mid = float(np.median(v))
        ax.bar(i, mid, color=named_colors[name], width=0.6)
        ax.errorbar(i, mid, yerr=[[mid - v.min()], [v.max() - mid]], color="black", capsize=4, linewidth=1)
        ax.scatter(i + np.linspace(-0.12, 0.12, len(v)) * (len(v) > 1), v, color="black", s=12, zorder=3)
        ax.annotate(f"{mid:.0f}", (i, v.max()), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)
    ax.set_xticks(range(len(values)), list(values), fontsize=8)
    ax.set_ylabel("goodput (output tok/s within the SLO)")
    ax.margins(y=0.12)


def occupancy_curves(steps: list[dict], bins: int = 24) -> list[np.ndarray]:
    """Per replica of one run, live slots / slots averaged over time in each of `bins` equal
    parts of the run (its first step's start to its last step's end, so runs of different
    lengths line up); time a replica spent between steps counts as no slot live."""
    steps = [s for s in steps if s["start"] is not None]
    if not steps:
        return []
    t0 = min(s["start"] for s in steps)
    edges = np.linspace(t0, max(s["start"] + s["duration"] for s in steps), bins + 1)
    curves = []
    for replica in sorted({s["replica_id"] for s in steps}):
        mine = [s for s in steps if s["replica_id"] == replica]
        start = np.array([s["start"] for s in mine])[:, None]
        end = start + np.array([s["duration"] for s in mine])[:, None]
        overlap = np.clip(np.minimum(end, edges[1:]) - np.maximum(start, edges[:-1]), 0, None)
        share = np.array([s["live_slots"] / s["num_slots"] for s in mine])
        curves.append(share @ overlap / np.diff(edges))
    return curves


def _band(ax, curves: list[np.ndarray], color) -> None:
    """The median of `curves` over the run and their 10-90% band."""
    if not curves:
        return
    stacked = np.vstack(curves)
    x = (np.arange(stacked.shape[1]) + 0.5) / stacked.shape[1]
    low, mid, high = np.percentile(stacked, [10, 50, 90], axis=0)
    ax.fill_between(x, low, high, color=color, alpha=0.15, linewidth=0)
    ax.plot(x, mid, color=color, linewidth=1.8)


def _workload(run: dict) -> str:
    """'kv-pressure, 100 requests at 0.8x capacity, 4 replicas', from what `slotserve run` records."""
    config = run["config"] or {}
    params = config.get("workload_params") or {}
    parts = [str(config.get("workload", run["name"])).split(" (")[0]]
    if "num_requests" in params:
        parts.append(
            f"{params['num_requests']} requests" + (f" at {params['load']:g}x capacity" if "load" in params else "")
        )
    if config.get("num_replicas"):
        parts.append(f"{config['num_replicas']} replicas")
    return ", ".join(parts)


# --- shared -----------------------------------------------------------------------------------


def occupancy_lines(ax, steps: list[dict], replica_colors: dict) -> None:
    """One line per replica in its colour: live slots / slots at each of its steps (the store's steps rows)."""
    t0 = min((s["start"] for s in steps), default=0.0)
    for replica in sorted({s["replica_id"] for s in steps}):
        mine = [s for s in steps if s["replica_id"] == replica]
        ax.plot(
            [s["start"] - t0 for s in mine],
            [s["live_slots"] / s["num_slots"] for s in mine],
            color=replica_colors[replica],
            linewidth=0.8,
        )
    ax.set_xlabel("time in run (s)")
    ax.set_ylabel("occupancy (live slots / slots)")


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _grid(n: int, width: float = 5.0, height: float = 3.2):
    """A figure of n panels, at most three a row (as many rows as it takes: a figure of a sweep
    draws every run it is given); the unused ones hidden."""
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = _figure(rows, cols, width * cols, height * rows + 0.4)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


# --- experiment sweeps --------------------------------------------------------------------


@dataclass
class SweepPoint:
    """One row of an experiment's table: its series (the row without the load), its load
    (None without a load axis) and each metric's values over seeds."""

    series: str
    load: float | None
    values: dict[str, list[float]]


def plot_sweep(
    points: list[SweepPoint], panels: list[tuple[str, str]], path: Path, title: str, series_colors: dict | None = None
) -> Path:
    """One panel per (metric, label). With a load axis a line per series against load, else a
    bar per series; the marker is the median over seeds, the error bar spans min to max.
    `series_colors` (default: `colors` of the series in order) lets a report's figures agree."""
    fig, axes = _grid(len(panels))
    by_load = any(p.load is not None for p in points)
    series = list(dict.fromkeys(p.series for p in points))
    series_colors = series_colors or colors(series)
    for ax, (metric, label) in zip(axes, panels):
        for i, name in enumerate(series):
            mine = [p for p in points if p.series == name and p.values[metric]]
            if not mine:
                continue
            values = [np.array(p.values[metric], dtype=float) for p in mine]
            mid = np.array([np.median(v) for v in values])
            err = np.array([mid - [v.min() for v in values], [v.max() for v in values] - mid])
            if by_load:
                ax.errorbar([p.load for p in mine], mid, yerr=err, marker="o", capsize=3, color=series_colors[name])
            else:
                ax.bar(i, mid[0], yerr=err[:, :1], capsize=3, color=series_colors[name])
        if by_load:
            ax.set_xlabel("load (x measured capacity)")
        else:
            ax.set_xticks(range(len(series)), series, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(label)
    figure_legend(fig, line_handles({name: series_colors[name] for name in series}))
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def plot_latency_cdfs(
    named: dict[str, Sequence[RequestTrace]], path: Path, title: str, named_colors: dict | None = None
) -> Path:
    """TTFT and ITL distributions, a line per name (its traces pooled), in `named_colors`
    (default: `colors` of the names)."""
    named_colors = named_colors or colors(named)
    fig, grid = _figure(1, 2, 11, 4.4)
    latency_cdfs(grid[0][0], grid[0][1], {name: [traces] for name, traces in named.items()}, named_colors)
    figure_legend(fig, line_handles({name: named_colors[name] for name in named}))
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def occupancy_figure(named_steps: dict[str, list[dict]], title: str):
    """A panel per name, every one given: each replica's occupancy over time, a replica the
    same colour in every panel (one legend for them all)."""
    fig, axes = _grid(len(named_steps))
    replica_colors = colors(sorted({s["replica_id"] for steps in named_steps.values() for s in steps}))
    for ax, (name, steps) in zip(axes, named_steps.items()):
        occupancy_lines(ax, steps, replica_colors)
        ax.set_ylim(0, 1.05)
        ax.set_title(name, fontsize=8)
    figure_legend(fig, line_handles(replica_colors))
    fig.suptitle(title, fontsize=9)
    return fig


def plot_occupancy(named_steps: dict[str, list[dict]], path: Path, title: str) -> Path:
    return _save(occupancy_figure(named_steps, title), path)


@dataclass
class SlotSpan:
    """The part of a request's life a slot timeline can show from the store: `lane` (a slot,
    numbered by greedy assignment), prefill from `start` to `first_token`, decode from there to
    `last_token`, all step boundaries on the replica's clock."""

    lane: int
    request_id: str
    start: float
    first_token: float
    last_token: float


def slot_spans(traces: Sequence[RequestTrace], steps: list[dict]) -> list[SlotSpan]:
    """One replica's requests as slot spans, derived from token times and that replica's steps
    (the store has no per-slot rows). A token is taken to be made by the latest step that ended
    by the time it was received; a request's prefill is the step that made its first token (so
    a prompt chunked over several steps shows only its last chunk), and it holds its slot until
    the step that made its last token ends (a static batch holds it longer, until the batch
    drains). Each span lies inside the request's true tenure, so greedy lanes need no more
    lanes than the replica has slots."""
    made = sorted((s["start"] + s["duration"], s["start"]) for s in steps if s["start"] is not None)
    ends = [end for end, _ in made]

    def step_of(t: float) -> tuple[float, float]:
        i = bisect.bisect_right(ends, t + 1e-6) - 1
        return made[i] if i >= 0 else (t, t)

    spans, lane_free = [], []  # lane_free[i]: when lane i's last span ended
    for t in sorted((t for t in traces if t.token_times), key=lambda t: t.token_times[0]):
        first_end, start = step_of(t.token_times[0])
        last_end, _ = step_of(t.token_times[-1])
        free = [i for i, end in enumerate(lane_free) if end <= start + 1e-9]
        if free:
            lane = free[0]
            lane_free[lane] = last_end
        else:
            lane = len(lane_free)
            lane_free.append(last_end)
        spans.append(SlotSpan(lane, t.request_id, start, first_end, last_end))
    return spans


def plot_slot_timelines(named: dict[str, tuple[list[SlotSpan], int]], path: Path) -> Path:
    """A panel per name: (spans, slots) of one replica; prefill dark, decode light, idle white."""
    fig, axes = _grid(len(named), width=6.0)
    for ax, (name, (spans, num_slots)) in zip(axes, named.items()):
        t0 = min((s.start for s in spans), default=0.0)
        ax.barh(
            [s.lane for s in spans],
            [s.first_token - s.start for s in spans],
            left=[s.start - t0 for s in spans],
            color="tab:red",
            label="prefill step",
        )
        ax.barh(
            [s.lane for s in spans],
            [s.last_token - s.first_token for s in spans],
            left=[s.first_token - t0 for s in spans],
            color="tab:blue",
            alpha=0.5,
            edgecolor="white",
            linewidth=0.5,
            label="decode",
        )
        ax.set_ylim(-0.6, max([num_slots] + [s.lane + 1 for s in spans]) - 0.4)
        ax.set_xlabel("time in run (s)")
        ax.set_ylabel("slot (greedy lane)")
        ax.set_title(name, fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels() if axes else ([], [])
    figure_legend(fig, dict(zip(labels, handles)))
    fig.suptitle(
        "Slot timeline of one replica's first requests, derived from token times and steps (the store "
        "has no per-slot rows): a lane is a slot (greedy),\nred = the step that made the first token, blue = "
        "decode to the step that made the last, white = free or (static batching) held by a finished request",
        fontsize=8,
    )
    return _save(fig, path)
