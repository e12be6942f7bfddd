"""Routing inside the client (`Client(routing="local")`): the pure `router.Router` runs in the
client's process, as Ray Serve's handle routes, so placing a request costs no Ray call.

It sees what the router actor sees, fetched in one batch: a background thread calls the actor's
`sync` every `period` seconds (the replicas' own report interval), which hands over the
decisions made here since the last call (recorded by the actor as its own, so the store and the
audit read the same) and returns every replica's last load report, the K/V event batches this
client's block index has not seen (so precise prefix routing runs here too; the actor keeps each
replica's last `KV_LOG_BATCHES`, and a client further behind starts again from the actor's
index), which replicas are down, and which it holds: a replica an autoscaler added is taken on
(down until the actor has it up), one it drained away is forgotten. Its in-flight counts and
reservations are this client's own requests: it is told of each end by the client (with the
output length, so length estimates learn), not by the replicas, whose completions go to the
actor as before. Several clients routing locally each know only their own requests between
reports; the actor's view counts every client's.

A cluster with prefill and decode pools is refused: its router (`router.pd_router.PdRouter`)
places a request on two pools and moves each hand-over, which a one-pool `Router` here would
get wrong; such a cluster is routed by its actor.
"""

from __future__ import annotations

import threading
import time
import weakref

import ray

from cluster.connection import ClusterError
from protocol.errors import SlotServeError
from protocol.routing import RouteRequest
from replica.serving.loop import REPORT_INTERVAL
from router.router import Router

ROUTING_MODES = ("actor", "local")


class LocalRouter:
    """A `Router` behind a lock (the client routes from its callers' threads and its event
    loop, and hears of ends on its feeds' threads), kept fresh by a sync thread."""

    def __init__(self, router_actor, replica_ids: list[str], period: float = REPORT_INTERVAL):
        status = ray.get(router_actor.status.remote(), timeout=60)
        pools = {r: role for r, role in status.get("roles", {}).items() if role != "mixed"}
        if pools:
            raise ClusterError(
                'routing="local" routes one pool of mixed replicas; this cluster has prefill and decode pools '
                f'({", ".join(f"{r}: {role}" for r, role in sorted(pools.items()))}): use routing="actor"'
            )
        self._router = Router(
            replica_ids,
            status["policy"],
            max_in_flight_per_replica=status["max_in_flight_per_replica"],
            max_in_flight=status["max_in_flight"],
            tpot_slo=status["tpot_slo"],
        )
        self._actor = router_actor
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.syncs = 0
        self.sync_errors = 0
        self.sync(timeout=60)
        # The thread holds this object weakly, so a dropped client's router stops syncing.
        threading.Thread(
            target=_sync_loop, args=(weakref.ref(self), self._stop, period), daemon=True, name="slotserve-sync"
        ).start()

    @property
    def policy(self) -> str:
        return self._router.policy.name

    @property
    def replica_ids(self) -> list[str]:
        """The replicas routed among here (the actor's, as of the last sync)."""
        with self._lock:
            return list(self._router.replica_ids)

    def route_many(self, requests: list[RouteRequest]) -> list[str | SlotServeError]:
        """As `RouterActor.route_many`: one answer per request, a replica id or the typed
        error that refused it."""
        answers: list[str | SlotServeError] = []
        with self._lock:
            for request in requests:
                try:
                    answers.append(self._router.route(request).replica_id)
                except SlotServeError as err:
                    answers.append(err)
        return answers

    def complete(self, request_id: str, replica_id: str | None = None, output_len: int | None = None) -> None:
        """As `Router.complete` (the same arguments in the same order)."""
        with self._lock:
            self._router.complete(request_id, replica_id, output_len)

    def replica_lost(self, replica_id: str, reason: str) -> None:
        with self._lock:
            if replica_id in self._router.replica_ids:
                self._router.mark_down(replica_id, f"lost: {reason}"[:200])

    def sync(self, timeout: float = 10.0) -> None:
        """Send the decisions made here, take the actor's replicas, reports and down marks."""
        with self._lock:
            decisions = self._router.drain_decisions()
            index = self._router.block_index
            kv_next = {r: n for r in self._router.replica_ids if (n := index.next_seq(r)) is not None}
        view = ray.get(self._actor.sync.remote(decisions, kv_next), timeout=timeout)
        down = view.down
        with self._lock:
            for replica_id, batches in view.kv_events.items():
                if replica_id in self._router.replica_ids:
                    for batch in batches:
                        index.apply(replica_id, batch)
            held = set(view.replica_ids)
            for replica_id in [r for r in view.replica_ids if r not in self._router.replica_ids]:
                self._router.add_replica(replica_id)
            for replica_id in [r for r in self._router.replica_ids if r not in held]:
                self._router.remove_replica(replica_id)  # its requests here were moved off it by the drain
            for report in view.reports.values():
                self._router.report(report)
            for replica_id in self._router.replica_ids:
                if replica_id in down and self._router.down.get(replica_id) != down[replica_id]:
                    self._router.mark_down(replica_id, down[replica_id])
                elif replica_id not in down and replica_id in self._router.down:
                    self._router.mark_up(replica_id)
        self.syncs += 1

    def close(self) -> None:
        """Stop syncing, after one last sync so the decisions made here are recorded."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self.sync()
        except Exception:  # noqa: BLE001 - best effort at close: the actor may be gone
            self.sync_errors += 1


def _sync_loop(ref: weakref.ref, stop: threading.Event, period: float) -> None:
    while not stop.wait(period):
        local = ref()
        if local is None or not ray.is_initialized():
            return
        try:
            local.sync()
        except Exception:  # noqa: BLE001 - a router Ray is restarting: the next sync catches up
            local.sync_errors += 1
            time.sleep(period)
        del local
