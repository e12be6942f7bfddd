"""Plots shared by the comparison, cluster and experiment commands (matplotlib, written to PNG)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from metrics.definitions import RequestTrace  # noqa: E402


def latency_cdfs(ax_ttft, ax_itl, named: dict[str, Sequence[RequestTrace]]) -> None:
    """TTFT and pooled inter-token-latency distributions, one line per name."""
    for name, traces in named.items():
        for ax, values in (
            (ax_ttft, [t.ttft for t in traces if t.ttft is not None]),
            (ax_itl, [g for t in traces for g in t.itls]),
        ):
            values = sorted(values)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    ax_ttft.set_xlabel("TTFT (s)")
    ax_itl.set_xlabel("inter-token latency (s)")
    ax_itl.set_xscale("log")
    for ax in (ax_ttft, ax_itl):
        ax.set_ylabel("share")
        ax.legend(fontsize=8)


def plot_cluster_runs(store, run_ids: list[int], path: Path) -> Path:
    """Per run: TTFT and ITL distributions; per replica of each run: occupancy over time."""
    runs = {f"run {r} ({store.run(r)['routing_policy']})": r for r in run_ids}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    latency_cdfs(axes[0], axes[1], {name: store.traces(r) for name, r in runs.items()})
    for name, run_id in runs.items():
        occupancy_lines(axes[2], store.steps(run_id), f"{name} ")
    axes[2].legend(fontsize=7)
    return _save(fig, path)


def occupancy_lines(ax, steps: list[dict], prefix: str = "") -> None:
    """One line per replica: live slots / slots at each of its steps (the store's steps rows)."""
    t0 = min((s["start"] for s in steps), default=0.0)
    for replica in sorted({s["replica_id"] for s in steps}):
        mine = [s for s in steps if s["replica_id"] == replica]
        ax.plot(
            [s["start"] - t0 for s in mine],
            [s["live_slots"] / s["num_slots"] for s in mine],
            label=f"{prefix}{replica}",
            linewidth=0.8,
        )
    ax.set_xlabel("time in run (s)")
    ax.set_ylabel("occupancy (live slots / slots)")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _grid(n: int, width: float = 5.0, height: float = 3.2):
    """A figure of n panels, at most three a row (as many rows as it takes: a figure of a sweep
    draws every run it is given); the unused ones hidden."""
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
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


def plot_sweep(points: list[SweepPoint], panels: list[tuple[str, str]], path: Path, title: str) -> Path:
    """One panel per (metric, label). With a load axis a line per series against load, else a
    bar per series; the marker is the median over seeds, the error bar spans min to max."""
    fig, axes = _grid(len(panels))
    by_load = any(p.load is not None for p in points)
    for ax, (metric, label) in zip(axes, panels):
        series = list(dict.fromkeys(p.series for p in points))
        for i, name in enumerate(series):
            mine = [p for p in points if p.series == name and p.values[metric]]
            if not mine:
                continue
            values = [np.array(p.values[metric], dtype=float) for p in mine]
            mid = np.array([np.median(v) for v in values])
            err = np.array([mid - [v.min() for v in values], [v.max() for v in values] - mid])
            if by_load:
                ax.errorbar([p.load for p in mine], mid, yerr=err, marker="o", capsize=3, label=name)
            else:
                ax.bar(i, mid[0], yerr=err[:, :1], capsize=3)
        if by_load:
            ax.set_xlabel("load (x measured capacity)")
            ax.legend(fontsize=7)
        else:
            ax.set_xticks(range(len(series)), series, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(label)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def plot_latency_cdfs(named: dict[str, Sequence[RequestTrace]], path: Path, title: str) -> Path:
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
    latency_cdfs(ax_ttft, ax_itl, named)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def occupancy_figure(named_steps: dict[str, list[dict]], title: str):
    """A panel per name, every one given: each replica's occupancy over time."""
    fig, axes = _grid(len(named_steps))
    for ax, (name, steps) in zip(axes, named_steps.items()):
        occupancy_lines(ax, steps)
        ax.set_ylim(0, 1.05)
        ax.set_title(name, fontsize=8)
        ax.legend(fontsize=7)
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
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(
        "Slot timeline of one replica's first requests, derived from token times and steps (the store "
        "has no per-slot rows): a lane is a slot (greedy),\nred = the step that made the first token, blue = "
        "decode to the step that made the last, white = free or (static batching) held by a finished request",
        fontsize=8,
    )
    return _save(fig, path)
