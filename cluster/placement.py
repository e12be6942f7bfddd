"""Placing the client's requests on replicas, and moving them when a replica goes.

`Placer.place` routes a request (the router actor's `admit_many`, with every request routed in
the same event-loop turn in one call, or the router inside the client,
`cluster.local_routing`) and submits it to the chosen replica, going on past replicas that are
dead or draining: at most `MAX_ATTEMPTS` placements of one request in all. A replica's stream
that breaks, or a draining replica that hands requests back, brings them to `Placer.move`, which
places each again with the tokens it delivered (so its stream goes on with no gap and no
duplicate) on the client's own event loop. A move the router refuses because no replica can
take it now (every one down or full while Ray restarts them) waits the refusal's retry-after
and asks again, for at most `MOVE_WAIT_SECONDS` and never past the caller's timeout: a request
is lost only when no replica comes back. Every move is a `MigrationRecord` on the request's
`Result`. Calls to a router that Ray is restarting are retried with backoff for
`ROUTER_RETRY_SECONDS`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from cluster.connection import ACTOR_GONE, ClusterError, actor_gone, router_handle, unwrap
from cluster.held import HeldRequests
from cluster.local_routing import LocalRouter
from cluster.loop_thread import LoopThread
from cluster.streams import Flight, ReplicaFeed, Sink, close_feeds
from protocol.errors import DrainingError, OverloadedError, RequestLostError, SlotServeError
from protocol.finish import NATURAL_ENDINGS
from protocol.messages import MigrationRecord, StreamEvent
from protocol.replicas import Submission
from protocol.routing import Admission, RouteRequest

MAX_ATTEMPTS = 4  # placements of one request (its first and up to three moves)
ROUTER_RETRY_SECONDS = 30.0
MOVE_WAIT_SECONDS = 60.0  # how long a moved request waits for a replica to take it
SUBMIT_TIMEOUT = 120.0
_MAX_RETRY_STEP = 1.0  # a refusal's retry-after is followed, but asked again at least this often


class TurnBatcher:
    """Calls made in one event-loop turn, sent together: `call(key, item)` waits for `item`'s
    answer, and once per turn and key `send(key, items)` is awaited with every item, returning
    one answer per item (a value, or the exception that refused it). A Ray call costs far more
    than the work it carries, so a burst of requests costs one call, not one each."""

    def __init__(self, send: Callable[[Any, list], Awaitable[list]]):
        self._send = send
        self._pending: dict[tuple[asyncio.AbstractEventLoop, Any], list[tuple[Any, asyncio.Future]]] = {}

    async def call(self, key: Any, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        batch = self._pending.setdefault((loop, key), [])
        batch.append((item, future))
        if len(batch) == 1:
            loop.call_soon(self._flush, loop, key)
        return await future

    def _flush(self, loop: asyncio.AbstractEventLoop, key: Any) -> None:
        batch = self._pending.pop((loop, key))
        sent = loop.create_task(self._send(key, [item for item, _ in batch]))

        def settle(done: asyncio.Task) -> None:
            try:
                answers = done.result()
            except BaseException as err:  # noqa: BLE001 - every waiting call gets the error
                answers = [err] * len(batch)
            for (_, future), answer in zip(batch, answers):
                if not future.done():
                    future.set_result(answer)

        sent.add_done_callback(settle)


class Placer:
    """The client's side of the cluster: the router (actor, or local), the replicas' handles,
    this client's feeds from them, and the placement and moves of its requests."""

    def __init__(self, loop: LoopThread, subscriber: str, local_routing: bool):
        self.router = router_handle()
        self.subscriber = subscriber
        self._loop = loop
        self._feeds: dict[str, ReplicaFeed] = {}
        self._feeds_lock = threading.Lock()
        self._routes = TurnBatcher(self._send_routes)
        self._submissions = TurnBatcher(self._send_submissions)
        self.replicas: dict = loop.run(self.router_call(lambda r: r.replicas.remote(), timeout=60))
        self.local = LocalRouter(self.router, list(self.replicas)) if local_routing else None
        self.held = HeldRequests(self.router_call, subscriber, lambda: self.router)

    def close(self) -> None:
        """End this client's streams on every replica it used (aborting its requests there) and
        stop its loop."""
        if self.local is not None:
            self.local.close()
        close_feeds(self.replicas, self._feeds, self.subscriber)
        self._loop.stop()

    # ---- the router, with retries while Ray restarts it ------------------------------------
    async def router_call(self, call: Callable, timeout: float = 30.0) -> Any:
        """`call(router)` and its result; while the router is dead or restarting, retried with
        backoff for ROUTER_RETRY_SECONDS (looking it up again, in case `up` replaced it)."""
        deadline, delay = time.monotonic() + ROUTER_RETRY_SECONDS, 0.1
        while True:
            try:
                return await asyncio.wait_for(call(self.router), timeout)
            except ray.exceptions.RayTaskError as err:
                raise unwrap(err) from None
            except TimeoutError:
                raise ClusterError(f"the slotserve router did not answer within {timeout:g} s") from None
            except ACTOR_GONE as err:
                if time.monotonic() > deadline:
                    raise ClusterError(f"the slotserve router is unreachable: {err}") from None
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)
            try:
                self.router = router_handle()
            except ClusterError:
                pass

    async def route(self, flight: Flight, moved_from: str | None) -> str:
        """The replica to send the flight to, or the typed error that refused it. Every request
        routed in the same event-loop turn (a burst of arrivals, the requests of a lost replica)
        goes to the router actor in one call: a Ray call costs far more than a routing
        decision. A local router answers at once. A request the router's flow control holds
        waits for its release (`cluster.held`)."""
        if self.local is not None:
            answer = self.local.route_many([flight.route(moved_from)])[0]
        else:
            answer = await self._routes.call(None, flight.route(moved_from))
        if isinstance(answer, Admission):
            answer = await self.held.wait(answer.request_id) if answer.held else answer.replica_id
        if isinstance(answer, BaseException):
            raise unwrap(answer)
        return answer

    async def _send_routes(self, _: None, routes: list[RouteRequest]) -> list[Admission | BaseException]:
        return await self.router_call(lambda r: r.admit_many.remote(routes, self.subscriber))

    async def _send_submissions(self, replica_id: str, submissions: list[Submission]) -> list:
        ref = self.replicas[replica_id].submit_many.remote(self.subscriber, submissions)
        return await asyncio.wait_for(ref, SUBMIT_TIMEOUT)

    # ---- placing ------------------------------------------------------------------------
    async def place(self, flight: Flight, moved_from: str | None = None) -> None:
        """Route and submit the flight, going on past replicas that are dead or draining, at
        most MAX_ATTEMPTS placements in all; raises the typed error that refused it. A new
        request (`moved_from` None) refused as overloaded fails at once (its caller decides);
        once moved, here or before, it waits for room (see the module docstring)."""
        patience = None  # from its first move on (this call's, or one made here: a prefill
        # replica's hand-over, a replica gone or draining), it may wait MOVE_WAIT_SECONDS for room
        while True:
            if moved_from is not None and patience is None:
                patience = time.monotonic() + MOVE_WAIT_SECONDS
            if flight.closed:
                raise ClusterError(f"request {flight.request_id!r} was left by its caller")
            flight.attempts += 1
            if flight.attempts > MAX_ATTEMPTS:
                raise RequestLostError(flight.request_id, MAX_ATTEMPTS, f"the last replica tried was {moved_from}")
            try:
                replica_id = await self.route(flight, moved_from)
            except OverloadedError as err:
                await self._wait_for_room(flight, err, patience)
                continue
            delivered = len(flight.token_ids)
            try:
                await self._submit(flight, replica_id)
            except DrainingError:
                pass  # go on to another replica
            except OverloadedError as err:  # its queue is full
                await self._wait_for_room(flight, err, patience)
            except Exception as err:  # noqa: BLE001 - anything else is Ray's: the replica is gone (told in _submit)
                if not actor_gone(err):
                    raise
                if len(flight.token_ids) > delivered:  # it ran there before the answer was lost: a move
                    self._loop.spawn(self._move(flight, replica_id, f"replica {replica_id} lost: {type(err).__name__}"))
                    return
            else:
                again = flight.settle(replica_id)
                if again is None:
                    flight.handover_from = None  # taken (or computed again) there
                else:  # placed, and handed back or cut off at once: a move of its own, recorded
                    self._loop.spawn(self._move(flight, replica_id, again))
                return
            moved_from = replica_id  # refused there, or gone

    @staticmethod
    async def _wait_for_room(flight: Flight, refused: OverloadedError, patience: float | None) -> None:
        """A moved request waits the refusal's retry-after before asking again (not counted as
        an attempt); a new one (no `patience`), or one whose wait would pass its patience or
        the caller's deadline, gets the refusal."""
        delay = min(max(refused.retry_after, 0.05), _MAX_RETRY_STEP)
        if patience is None or flight.closed:
            raise refused
        until = patience if flight.deadline is None else min(patience, flight.deadline)
        if time.monotonic() + delay > until:
            raise refused
        flight.attempts -= 1
        await asyncio.sleep(delay)

    async def _submit(self, flight: Flight, replica_id: str) -> None:
        """Submit to the replica (on its feed first, so no event is missed). A replica that is
        gone is told to the router; its error, or a replica's typed refusal, is raised."""
        sender = None if flight.handover_from is None else self.replicas.get(flight.handover_from)
        await self._feed(replica_id, flight)
        submission = Submission(
            flight.prompt, flight.sampling, flight.request_id, flight.result.arrival, flight.resume(), sender
        )
        answer = await self._submissions.call(replica_id, submission)
        if isinstance(answer, BaseException):
            self.unfeed(flight)
            if actor_gone(answer):
                await self.tell_lost(replica_id, type(answer).__name__)
                raise answer
            raise unwrap(answer) from None
        flight.kv_fetch = answer

    async def _feed(self, replica_id: str, flight: Flight) -> None:
        """Put the flight on this client's stream from the replica, opening one if needed."""
        if replica_id not in self.replicas:
            self.replicas.update(await self.router_call(lambda r: r.replicas.remote()))
        flight.placing, flight.handed_back = True, None
        with self._feeds_lock:
            feed = self._feeds.get(replica_id)
            if feed is None or not feed.add(flight):
                feed = ReplicaFeed(self, self.replicas[replica_id], self.subscriber, replica_id)
                self._feeds[replica_id] = feed
                feed.add(flight)
        flight.feed = feed
        flight.replica_id = flight.result.replica_id = replica_id

    def unfeed(self, flight: Flight) -> None:
        flight.unfeed()
        if self.local is not None:
            self.local.complete(flight.request_id, flight.replica_id)

    def abort(self, flight: Flight) -> None:
        """The caller left before the end: stop the replica computing for it."""
        flight.closed = True
        if flight.replica_id is not None:  # else it was never sent anywhere
            self.unfeed(flight)
            self.replicas[flight.replica_id].abort.remote(self.subscriber, flight.request_id)

    def local_sink(self, flight: Flight, sink: Sink) -> Sink:
        """With a local router, the flight's sink tells it of the end (and the output length)."""
        if self.local is None:
            return sink

        def sink_and_tell(event: StreamEvent) -> None:
            if event.finished:  # the feed has added its tokens to the flight already
                natural = event.finish_reason in NATURAL_ENDINGS
                self.local.complete(flight.request_id, event.replica_id, len(flight.token_ids) if natural else None)
            sink(event)

        return sink_and_tell

    # ---- moves --------------------------------------------------------------------------
    async def tell_lost(self, replica_id: str, reason: str) -> None:
        if self.local is not None:
            self.local.replica_lost(replica_id, reason)
        try:
            await self.router_call(lambda r: r.replica_lost.remote(replica_id, reason), timeout=10)
        except SlotServeError:
            pass  # the router's own health check finds it

    def replica_lost(self, replica_id: str, flights: list[Flight], reason: str) -> None:
        """A replica's stream broke (a feed's thread): tell the router, then move its requests."""
        self._loop.spawn(self._moves(flights, replica_id, f"replica {replica_id} lost: {reason}", lost=reason))

    def move(self, flights: list[Flight], from_replica: str, reason: str) -> None:
        """Place the requests again, each with the tokens it delivered (from a feed's thread)."""
        self._loop.spawn(self._moves(flights, from_replica, reason))

    async def _moves(self, flights: list[Flight], from_replica: str, reason: str, lost: str | None = None) -> None:
        if lost is not None:
            await self.tell_lost(from_replica, lost)
        await asyncio.gather(*[self._move(flight, from_replica, reason) for flight in flights])

    async def _move(self, flight: Flight, from_replica: str, reason: str) -> None:
        """One request moved; if no replica takes it, it ends with an error event naming why. A
        hand-over (prefill/decode disaggregation) is the request's plan, not a failed placement:
        it takes none of its MAX_ATTEMPTS."""
        carried = len(flight.token_ids)
        if flight.handover_from is not None:
            flight.attempts -= 1
        flight.kv_fetch, flight.moving = None, True
        try:
            await self.place(flight, from_replica)
            to = flight.replica_id
        except Exception as err:  # noqa: BLE001 - whatever refused it, its caller hears why
            flight.end(from_replica, f"{reason}; not resumed: {unwrap(err)}")
            to = None
        fetch = flight.kv_fetch
        kv = {} if fetch is None else {"kv_bytes": fetch.nbytes, "kv_seconds": fetch.seconds}
        if fetch is not None and fetch.fallback is not None:
            reason = f"{reason}; K/V computed again: {fetch.fallback}"
        record = MigrationRecord(flight.request_id, from_replica, to, carried, reason, time.time(), **kv)
        flight.result.migrations.append(record)
        flight.moved()
