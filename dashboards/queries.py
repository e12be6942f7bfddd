"""A Grafana dashboard JSON read back into the PromQL its panels run, with the dashboard's
variables filled in: what `slotserve dashboard render` draws and the tests evaluate."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


@dataclass(frozen=True)
class PanelQuery:
    panel: str  # panel title
    kind: str  # Grafana panel type
    unit: str
    ref: str  # the target's refId
    expr: str  # PromQL, variables filled in
    legend: str

    @property
    def split_by(self) -> tuple[str, ...]:
        """The labels the legend names: the query returns one series per value of them."""
        return tuple(_LEGEND_LABEL.findall(self.legend))

    def label(self, labels: dict[str, str]) -> str:
        """The legend of one series, as Grafana writes it."""
        return _LEGEND_LABEL.sub(lambda m: labels.get(m.group(1), ""), self.legend) or self.ref


def fill(expr: str, window: str, values: dict[str, str] | None = None) -> str:
    """Put `window` for Grafana's `$__rate_interval` and a regex for each variable (".*" for
    all, unless `values` names one)."""
    values = values or {}

    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name in ("__rate_interval", "__interval"):
            return window
        return values.get(name, ".*")

    return _VARIABLE.sub(one, expr)


def panel_queries(dashboard: dict | Path, window: str, values: dict[str, str] | None = None) -> list[PanelQuery]:
    """Every target of every panel (rows skipped), in the dashboard's order."""
    if isinstance(dashboard, Path):
        dashboard = json.loads(dashboard.read_text())
    return [
        PanelQuery(
            panel["title"],
            panel["type"],
            panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
            target["refId"],
            fill(target["expr"], window, values),
            target.get("legendFormat", ""),
        )
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]
