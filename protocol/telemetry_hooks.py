"""The hooks a replica actor and the router actor call as they work, for live metrics.

The actors are given a factory for the real exporter (`cluster.prometheus_exporters`), so neither
`replica` nor `router` imports the cluster package; an actor given none uses these no-op
bases. Every hook is cheap and never raises into serving."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ReplicaTelemetry:
    """What a replica reports; arguments are the engine's own objects (a request id, a
    `StepRecord`, a `RequestOutput`, a `LoadReport`)."""

    def on_submit(self, request_id: str) -> None:
        """The engine accepted the request."""

    def on_reject(self, request_id: str) -> None:
        """The engine refused the request (invalid or too long)."""

    def on_step(self, record: Any) -> None:
        """An engine step ran."""

    def on_finish(self, output: Any) -> None:
        """A request ended (its final output)."""

    def on_load(self, load: Any) -> None:
        """The replica's load at a step boundary or when it went idle."""

    def on_handover(self, fetch: Any) -> None:
        """A request handed over by another replica was admitted here (`protocol.handover.KvFetch`:
        the K/V bytes taken in and the seconds the fetch took, or why it computes them again)."""

    def set_run(self, run_id: int | None) -> None:
        """Counts from now on belong to this run."""

    def snapshot(self) -> dict:
        """Cumulative counts for a live view (`slotserve top`)."""
        return {}


class RouterTelemetry:
    """What the router reports."""

    def route(self, route: Callable[..., Any], *args: Any) -> Any:
        """Make one routing decision, `route(*args)`, and return it (an exporter times it and
        counts the dispatch, or the refusal)."""
        return route(*args)

    def set_run(self, run_id: int | None) -> None:
        """Counts from now on belong to this run."""

    def flow(self, priority: int, tenant: str, outcome: str) -> None:
        """A request's way through flow control: "dispatched" at once, "held", "released" from
        hold to a replica, or "refused" (a tenant's limit, its deadline, shed)."""

    def flow_held(self, held_by_band: dict[int, int]) -> None:
        """The requests flow control holds now, per priority band."""
