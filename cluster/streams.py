"""A request's stream at the client: the `Result` its caller gets, the `Flight` the client keeps
while it runs (what was asked, where it runs, what has been delivered: all it takes to move
it), and the `ReplicaFeed`, this client's one event stream from a replica, fanned out to the
flights placed there."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import ray

from cluster.connection import actor_gone, unwrap
from metrics.definitions import RequestTrace
from protocol import defaults
from protocol.finish import FinishReason
from protocol.handover import PREFILL_HANDOVER, KvFetch
from protocol.messages import MigrationRecord, StreamEvent
from protocol.replicas import Resume
from protocol.routing import RouteRequest
from replica.scheduling.request import SamplingParams


@dataclass
class Result:
    request_id: str
    replica_id: str | None
    arrival: float
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    completion: float | None = None
    migrations: list[MigrationRecord] = field(default_factory=list)
    # Prompt tokens the prefix cache of the replica it ended on held when that replica first
    # admitted it (from its last event; None: not admitted, or the replica keeps no count).
    cached_tokens: int | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    def add(self, event: StreamEvent) -> None:
        self.replica_id = event.replica_id or self.replica_id
        self.token_ids += event.token_ids
        self.token_times += [event.time] * len(event.token_ids)
        self.text += event.text
        if event.finished:
            self.finish_reason, self.error, self.completion = event.finish_reason, event.error, event.time
            self.cached_tokens = event.cached_tokens

    def trace(
        self,
        prompt_len: int,
        max_tokens: int | None = None,
        session_id: str | None = None,
        planned_arrival: float | None = None,
        submitted: float | None = None,
        priority: int = defaults.PRIORITY,
        tenant: str = defaults.TENANT,
    ) -> RequestTrace:
        """The request as the metrics store records it (`submitted`: when the driver sent it,
        for its lateness against `planned_arrival`)."""
        planned = self.arrival if planned_arrival is None else planned_arrival
        return RequestTrace(
            self.request_id,
            self.arrival,
            self.token_times,
            time.time() if self.completion is None else self.completion,
            self.finish_reason or "error",
            prompt_len,
            self.replica_id,
            session_id=session_id,
            max_tokens=max_tokens,
            error=self.error,
            planned_arrival=planned,
            submit_lateness=(self.arrival if submitted is None else submitted) - planned,
            cached_tokens=self.cached_tokens,
            priority=priority,
            tenant=tenant,
        )


Sink = Callable[[StreamEvent], None]


@dataclass
class Flight:
    """One request in flight, as the client keeps it to move it: what was asked, where it
    runs, and what has been delivered to the caller so far."""

    result: Result
    prompt: str | list[int]
    sampling: SamplingParams
    session_id: str | None
    sink: Sink
    prompt_len: int
    tenant: str = defaults.TENANT  # its class for the router's flow control, with `sampling.priority`
    replica_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    attempts: int = 0
    deadline: float | None = None  # monotonic: the caller's timeout, which a move waits within
    closed: bool = False  # its caller left (aborted): a move in progress gives it up
    # Between registering on a replica's feed and that replica accepting it, the placer owns
    # the request: a feed that breaks, or a replica that hands it back, leaves it to the placer
    # (`Flight.settle`), so no request is ever moved twice at once.
    feed: ReplicaFeed | None = None
    placing: bool = False
    handed_back: str | None = None  # why its replica handed it back while it was being placed
    # The prompt's chained block hashes (`protocol.blocks`), for prefix-aware routing.
    block_hashes: tuple[int, ...] = ()
    block_size: int = defaults.BLOCK_SIZE
    # The replica that handed it over and holds its K/V for the next one to fetch (prefill/decode
    # disaggregation), until a replica accepts it; and what that replica's fetch came to.
    handover_from: str | None = None
    kv_fetch: KvFetch | None = None
    # While a move places it, its final event waits until the move's record is on its result
    # (a caller reading `Result.migrations` at the end must find it there).
    moving: bool = False
    _held_end: StreamEvent | None = None
    _end_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def request_id(self) -> str:
        return self.result.request_id

    def route(self, moved_from: str | None) -> RouteRequest:
        """What the router is told; the caller's timeout is its deadline there (wall clock), so
        flow control refuses it rather than holding it past the time anyone waits for it."""
        deadline = None if self.deadline is None else time.time() + (self.deadline - time.monotonic())
        return RouteRequest(
            self.request_id,
            self.prompt_len,
            self.sampling.max_tokens,
            self.session_id,
            self.block_hashes,
            self.block_size,
            moved_from,
            self.result.arrival,
            self.sampling.priority,
            self.tenant,
            deadline,
        )

    def resume(self) -> Resume | None:
        return Resume(list(self.token_ids), self.text) if self.token_ids else None

    def end(self, replica_id: str, reason: str) -> None:
        now = time.time()
        event = StreamEvent(self.request_id, replica_id, [], "", now, True, FinishReason.ERROR, reason, now)
        if not self.hold_end(event):
            self.sink(event)

    def settle(self, replica_id: str) -> str | None:
        """The replica accepted the flight: hand it to its feed. Returns why it must move again
        at once (None: it stays): the feed broke meanwhile, or the replica already handed it back
        (a prefill replica can hand a request over before its submit call has returned)."""
        feed = self.feed
        with feed.lock:
            self.placing = False
            again = f"stream from {replica_id} broke" if feed.dead else self.handed_back
            if again is not None:
                feed.flights.pop(self.request_id, None)
        return again

    def hold_end(self, event: StreamEvent) -> bool:
        """Keep the final event back while a move is recording itself (a feed's thread)."""
        with self._end_lock:
            if self.moving:
                self._held_end = event
            return self.moving

    def moved(self) -> None:
        """The move's record is on the result: deliver the final event if it came meanwhile."""
        with self._end_lock:
            self.moving, held, self._held_end = False, self._held_end, None
        if held is not None:
            self.sink(held)

    def unfeed(self) -> None:
        """The flight left its replica unfinished (aborted, or refused there): stop reading it."""
        if self.feed is not None:
            with self.feed.lock:
                self.feed.flights.pop(self.request_id, None)


class Mover(Protocol):
    """What a feed hands the flights of a broken stream to (`cluster.placement.Placer`)."""

    def replica_lost(self, replica_id: str, flights: list[Flight], reason: str) -> None: ...

    def move(self, flights: list[Flight], from_replica: str, reason: str) -> None: ...


class ReplicaFeed:
    """This client's event stream from one replica (one message per engine step), read on a
    background thread and fanned out to each request's sink. A stream the replica ended (idle
    too long) is reopened while requests are in flight; one that breaks hands its requests to
    the mover. It holds the mover weakly, so a dropped client is collected (and its streams
    closed) even while this thread waits."""

    def __init__(self, mover: Mover, handle, subscriber: str, replica_id: str):
        self.flights: dict[str, Flight] = {}
        self.lock = threading.Lock()
        self.dead = False
        self._mover = weakref.ref(mover)
        self._handle = handle
        self._subscriber = subscriber
        self._replica_id = replica_id
        self._gen = handle.events.remote(subscriber)
        threading.Thread(target=self._read, daemon=True, name=f"slotserve-feed-{replica_id}").start()

    def add(self, flight: Flight) -> bool:
        """Take the flight unless this feed has ended (the caller then opens a new one)."""
        with self.lock:
            if self.dead:
                return False
            self.flights[flight.request_id] = flight
            return True

    def _read(self) -> None:
        try:
            while True:
                for ref in self._gen:
                    if not ray.is_initialized():  # the driver shut Ray down under us: stop quietly
                        return
                    self._dispatch(ray.get(ref), time.time())
                with self.lock:
                    if not self.flights:  # ended by the replica (idle, or closed): a new one opens on demand
                        self.dead = True
                        return
                self._gen = self._handle.events.remote(self._subscriber)
        except Exception as err:  # noqa: BLE001 - the replica died, refused the stream, or Ray went away
            with self.lock:
                self.dead = True
                flights = [f for f in self.flights.values() if not f.placing]  # placers see `dead`
                self.flights = {}
            mover = self._mover()
            if mover is None or not ray.is_initialized() or not flights:
                return
            if actor_gone(err):
                mover.replica_lost(self._replica_id, flights, f"{type(err).__name__}: {str(err)[:200]}")
            else:  # e.g. OverloadedError: too many client streams there; the requests go elsewhere
                mover.move(flights, self._replica_id, f"stream refused: {unwrap(err)}")

    def _dispatch(self, batch: list[StreamEvent], now: float) -> None:
        moved, why = [], "replica draining"
        for event in batch:
            flight = self.flights.get(event.request_id)
            if flight is None:  # an aborted or refused request: its last events are dropped
                continue
            if event.finished:
                with self.lock:
                    self.flights.pop(event.request_id, None)
                    if event.finish_reason == FinishReason.MIGRATE:  # handed back: it goes on elsewhere
                        why = event.error or (PREFILL_HANDOVER if event.handed_over else why)
                        flight.handover_from = self._replica_id if event.handed_over else None
                        if flight.placing:
                            flight.handed_back = why  # its placer moves it
                        else:
                            moved.append(flight)
                        continue
            flight.token_ids += event.token_ids
            flight.text += event.text
            stamped = event.stamped(now)
            if not (event.finished and flight.hold_end(stamped)):
                flight.sink(stamped)
        if moved and (mover := self._mover()) is not None:
            mover.move(moved, self._replica_id, why)


def close_feeds(replicas: dict, feeds: dict, subscriber: str) -> None:
    """End this client's streams on every replica it used (at close, collection or exit)."""
    if not ray.is_initialized():
        return
    for replica_id in list(feeds):
        try:
            replicas[replica_id].close_events.remote(subscriber)
        except Exception:  # noqa: BLE001, S110 - best effort: the replica ends idle streams on its own
            pass
    feeds.clear()
