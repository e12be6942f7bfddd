"""Draw every panel of a dashboard JSON as PNG from the same PromQL, evaluated over a time range
through Prometheus's HTTP API: the picture without a Grafana server, and proof the queries work.

One PNG per panel (named after its title) and `dashboard.png` with all of them on one page.
Every time axis spans the whole range asked for, so panels line up and a series that starts
late shows where it starts; a share (Grafana's `percentunit`) is drawn on 0 to 100%, so a
near-even split reads as even; tick labels carry as many digits as their spacing needs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402 - after choosing the backend
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, PercentFormatter  # noqa: E402

from dashboards.prometheus import Prometheus, Series  # noqa: E402
from dashboards.queries import PanelQuery, panel_queries  # noqa: E402

COLUMNS = 3


@dataclass
class DrawnPanel:
    title: str
    kind: str
    unit: str
    lines: list[tuple[str, Series]]  # (legend, series) over every target of the panel

    @property
    def empty(self) -> bool:
        return not any(series.finite for _, series in self.lines)


def collect(
    prometheus: Prometheus, queries: list[PanelQuery], start: float, end: float, step: float
) -> list[DrawnPanel]:
    """Evaluate each panel's targets over [start, end], panels in the dashboard's order."""
    panels: dict[str, DrawnPanel] = {}
    for q in queries:
        panel = panels.setdefault(q.panel, DrawnPanel(q.panel, q.kind, q.unit, []))
        for series in sorted(prometheus.query_range(q.expr, start, end, step), key=lambda s: q.label(s.labels)):
            panel.lines.append((q.label(series.labels), series))
    return list(panels.values())


def seconds(v: float) -> str:
    """A duration with the unit its size needs (µs, ms or s), three significant digits."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {unit}"
    return "0 s" if v == 0 else f"{v / 1e-6:.3g} µs"


def _formatter(unit: str) -> FuncFormatter | PercentFormatter:
    if unit == "percentunit":
        return PercentFormatter(xmax=1.0, decimals=None)  # decimals from the axis's range
    if unit == "s":
        return FuncFormatter(lambda v, _: seconds(v))
    return FuncFormatter(lambda v, _: f"{v:g}")


def _value_text(unit: str, v: float) -> str:
    if unit == "percentunit":
        return f"{v * 100:.1f}%"
    return seconds(v) if unit == "s" else f"{v:.3g}"


def draw(ax: plt.Axes, panel: DrawnPanel, start: float, end: float) -> None:
    """One panel on `ax`, its time axis from `start` to `end` (unix seconds)."""
    ax.set_title(panel.title, fontsize=9)
    ax.tick_params(labelsize=7)
    if panel.empty:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        return
    if panel.kind == "bargauge":  # Grafana shows the value now; a picture of a range shows its mean
        names = [name for name, s in panel.lines if s.finite]
        values = [sum(v for _, v in s.finite) / len(s.finite) for _, s in panel.lines if s.finite]
        bars = ax.barh(names, values, color="tab:orange")
        ax.bar_label(bars, [_value_text(panel.unit, v) for v in values], fontsize=7, padding=2)  # a 0 reads as 0
        ax.set_title(f"{panel.title} (mean over the range)", fontsize=9)
        ax.xaxis.set_major_formatter(_formatter(panel.unit))
        if panel.unit == "percentunit":
            ax.set_xlim(0, max(1.0, *values))
        return
    if panel.kind == "heatmap":
        times = sorted({t for _, s in panel.lines for t, _ in s.points})
        index = {t: i for i, t in enumerate(times)}
        grid = [[math.nan] * len(times) for _ in panel.lines]
        for row, (_, series) in enumerate(panel.lines):
            for t, v in series.points:
                grid[row][index[t]] = v
        extent = (mdates.date2num(_when(times[0])), mdates.date2num(_when(times[-1])), len(grid) - 0.5, -0.5)
        image = ax.imshow(grid, aspect="auto", cmap="Oranges", vmin=0, vmax=1, extent=extent, interpolation="nearest")
        ax.set_yticks(range(len(panel.lines)), [name for name, _ in panel.lines])
        ax.xaxis_date()
        _time_axis(ax, start, end)
        plt.colorbar(image, ax=ax, format=_formatter(panel.unit)).ax.tick_params(labelsize=7)
        return
    for name, series in panel.lines:
        points = series.points
        ax.plot([_when(t) for t, _ in points], [v for _, v in points], label=name, linewidth=1.2)
    ax.yaxis.set_major_formatter(_formatter(panel.unit))
    if panel.unit == "percentunit":
        ax.set_ylim(0, max(1.0, max(v for _, s in panel.lines for _, v in s.finite)))
    _time_axis(ax, start, end)
    ax.legend(fontsize=6, loc="best")
    ax.grid(alpha=0.3)


def _time_axis(ax: plt.Axes, start: float, end: float) -> None:
    ax.set_xlim(_when(start), _when(end))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=6))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))


def _when(t: float) -> datetime:
    return datetime.fromtimestamp(t)


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def render(
    prometheus: Prometheus,
    dashboard: Path,
    out: Path,
    start: float,
    end: float,
    step: float = 2.0,
    window: str = "15s",
    values: dict[str, str] | None = None,
) -> list[DrawnPanel]:
    """Write one PNG per panel and `dashboard.png` into `out`; returns what was drawn."""
    panels = collect(prometheus, panel_queries(dashboard, window, values), start, end, step)
    out.mkdir(parents=True, exist_ok=True)
    for panel in panels:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        draw(ax, panel, start, end)
        fig.tight_layout()
        fig.savefig(out / f"{_slug(panel.title)}.png", dpi=110)
        plt.close(fig)
    rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(6 * COLUMNS, 3.2 * rows))
    for ax, panel in zip(axes.flat, panels):
        draw(ax, panel, start, end)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    span = f"{_when(start):%Y-%m-%d %H:%M:%S} to {_when(end):%H:%M:%S}"
    fig.suptitle(f"slotserve cluster, {span} (window {window})", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(out / "dashboard.png", dpi=80)
    plt.close(fig)
    return panels
