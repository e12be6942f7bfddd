"""A small client of Prometheus's HTTP API (`/api/v1/query`, `/api/v1/query_range`), standard
library only: what `slotserve dashboard render` and the tests query through."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from protocol.errors import SlotServeError


class PrometheusError(SlotServeError):
    """Prometheus could not be reached, or refused a query (the query and its answer are named)."""


@dataclass
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]  # (unix time, value); NaN where the expression is undefined

    @property
    def finite(self) -> list[tuple[float, float]]:
        return [(t, v) for t, v in self.points if math.isfinite(v)]


def _points(result: dict) -> list[tuple[float, float]]:
    """A result's points: an instant vector's one `value` or a matrix's `values`."""
    return [(float(t), float(v)) for t, v in result.get("values", [result.get("value")])]


class Prometheus:
    def __init__(self, url: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, str | float]) -> dict:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as err:  # a bad query comes back as 400 with Prometheus's reason
            body = json.loads(err.read() or b"{}")
        except (urllib.error.URLError, OSError) as err:
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {err}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"Prometheus refused {params.get('query')!r}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[Series]:
        """The expression's value at one instant (now by default): one point per series, or for a
        range selector (`name[6s]`) the raw samples it holds."""
        params: dict[str, str | float] = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self._get("/api/v1/query", params)
        return [Series(r["metric"], _points(r)) for r in data["result"]]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        """The expression evaluated every `step` seconds from `start` to `end`."""
        data = self._get("/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step})
        return [Series(r["metric"], _points(r)) for r in data["result"]]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=self.timeout) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False
