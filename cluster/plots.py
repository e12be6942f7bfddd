"""Plots shared by the comparison and cluster commands (matplotlib, written to PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cluster.metrics import RequestTrace  # noqa: E402


def latency_cdfs(ax_ttft, ax_itl, named: dict[str, Sequence[RequestTrace]]) -> None:
    """TTFT and pooled inter-token-latency distributions, one line per name."""
    for name, traces in named.items():
        for ax, values in ((ax_ttft, [t.ttft for t in traces if t.ttft is not None]),
                           (ax_itl, [g for t in traces for g in t.itls])):
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
        steps = store.steps(run_id)
        t0 = min((s["time"] for s in steps), default=0.0)
        for replica in sorted({s["replica_id"] for s in steps}):
            mine = [s for s in steps if s["replica_id"] == replica]
            axes[2].plot([s["time"] - t0 for s in mine], [s["live_slots"] / s["num_slots"] for s in mine],
                         label=f"{name} {replica}", linewidth=0.8)
    axes[2].set_xlabel("time in run (s)")
    axes[2].set_ylabel("occupancy (live slots / slots)")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
