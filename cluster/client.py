# Over 400 lines: the request's whole life at the client (placement, its stream, migration) sits together.
"""The Python client: submit requests to a running slotserve cluster and stream the tokens.

`Client.generate` blocks, `Client.stream` yields tokens as the replica makes them, and the
`a`-prefixed versions do the same under asyncio. The client asks the router which replica
to use, submits there, and reads the tokens from that replica directly: the router is never
on the per-token path. Each replica sends this client one message per engine step with all
of its requests' new tokens. The client stamps arrival and every token's receipt on its own
clock.

Nothing accepted is lost when a replica goes. The client keeps, for each request in flight,
the tokens it has delivered; when a replica's stream breaks (the actor died, or its node) or a
draining replica hands a request back, the router is told and the request is placed on
another replica with those tokens to prefill after the prompt, so the caller's stream goes on
with no gap and no duplicate (greedy output equals an undisturbed run). A request is moved at
most MAX_ATTEMPTS times, then ends with RequestLostError's message. Every move is a
`MigrationRecord` on the request's `Result`. Calls to a router that Ray is restarting are
retried with backoff for ROUTER_RETRY_SECONDS.
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import ray

from cluster.local_routing import ROUTING_MODES, LocalRouter
from metrics.definitions import RequestTrace
from protocol.blocks import block_hashes
from protocol.errors import DrainingError, RequestLostError, SlotServeError
from protocol.messages import MigrationRecord, StreamEvent
from replica.config import EngineConfig
from replica.errors import InvalidRequestError
from replica.scheduling.request import SamplingParams, validate_prompt, validate_request_id
from router.actor import ROUTER_ACTOR_NAME

NAMESPACE = "slotserve"
MAX_ATTEMPTS = 4  # placements of one request (its first and up to three moves)
ROUTER_RETRY_SECONDS = 30.0


class ClusterError(SlotServeError):
    """No cluster where one was expected, or the cluster failed a request."""


class RequestTimeoutError(ClusterError, TimeoutError):
    """The request did not finish within the caller's `timeout`; it was aborted on its replica."""


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail fast on a dead address instead of letting ray.init retry for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except (OSError, ValueError) as err:
        raise ClusterError(
            f"cannot reach a Ray cluster at {address!r} ({err}); "
            "start one with `ray start --head` or give its HOST:PORT"
        ) from None


def _local_cluster_address() -> str:
    """The address `ray start` left on this machine (RAY_ADDRESS first), as ray.init("auto")
    would find it; ConnectionError when there is none."""
    from ray._private.services import canonicalize_bootstrap_address

    address = canonicalize_bootstrap_address("auto")
    if address is None:
        raise ConnectionError("no address recorded")
    return address


def _use_token_auth() -> None:
    """Send Ray's auth token when one is on this machine (~/.ray/auth_token, RAY_AUTH_TOKEN or
    RAY_AUTH_TOKEN_PATH) and RAY_AUTH_MODE is unset. ray.init does this itself only for a
    cluster it finds on its own, never for an explicit address, so `--address` against a
    cluster with token auth (the default once a token exists) failed with InvalidAuthToken. A
    cluster without auth ignores the token."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def connect(address: str | None = None) -> None:
    """Join the Ray cluster at `address`, or the one `ray start` made on this machine. The
    address is checked first, so a dead one (or a stale record of a stopped cluster) is a
    clear error at once rather than minutes of retries."""
    if ray.is_initialized():
        return
    try:
        target = address if address not in (None, "auto") else _local_cluster_address()
    except ConnectionError as err:
        raise ClusterError(
            f"no Ray cluster running here: start one with `ray start --head` or `slotserve up` ({err})"
        ) from None
    _check_reachable(target)
    _use_token_auth()
    try:
        ray.init(address=target, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as err:
        raise ClusterError(
            f"no Ray cluster running at {target}: start one with `ray start --head` or `slotserve up` ({err})"
        ) from None


def router_handle():
    try:
        return ray.get_actor(ROUTER_ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ClusterError("no slotserve router on this Ray cluster: start one with `slotserve up`") from None


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

    def trace(
        self,
        prompt_len: int,
        max_tokens: int | None = None,
        session_id: str | None = None,
        planned_arrival: float | None = None,
        submitted: float | None = None,
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
        )


def _unwrap(err: Exception) -> Exception:
    """A replica's typed error (e.g. InvalidRequestError) instead of Ray's wrapper around it. The
    wrapper of a typed error is also an instance of it (Ray subclasses both), but its message is
    the remote traceback: the error's own `cause` is what callers show."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, SlotServeError):
        return cause
    return err if isinstance(err, SlotServeError) else ClusterError(f"request failed in the cluster: {err}")


def _replica_gone(err: Exception) -> bool:
    """Ray says the actor is dead or cannot be reached (not: the request itself failed)."""
    return isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


Sink = Callable[[StreamEvent], None]


@dataclass
class _Flight:
    """One request in flight, as the client keeps it to move it: what was asked, where it
    runs, and what has been delivered to the caller so far."""

    result: Result
    prompt: str | list[int]
    sampling: SamplingParams
    session_id: str | None
    sink: Sink
    prompt_len: int
    replica_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    attempts: int = 0
    # Between registering on a replica's feed and that replica accepting it, the placer owns
    # the request: a feed that breaks, or a replica that hands it back, leaves it to the placer
    # (`Client._settle`), so no request is ever moved twice at once.
    feed: _Feed | None = None
    placing: bool = False
    handed_back: bool = False
    # The prompt's chained block hashes (`protocol.blocks`), for prefix-aware routing.
    block_hashes: tuple[int, ...] = ()
    block_size: int = 16

    @property
    def request_id(self) -> str:
        return self.result.request_id

    def route(self, moved_from: str | None) -> tuple:
        return (
            self.request_id,
            self.prompt_len,
            self.sampling.max_tokens,
            self.session_id,
            moved_from,
            self.block_hashes,
            self.block_size,
        )

    def resume(self) -> tuple[list[int], str] | None:
        return (list(self.token_ids), self.text) if self.token_ids else None

    def end(self, replica_id: str, reason: str) -> None:
        now = time.time()
        self.sink(StreamEvent(self.request_id, replica_id, [], "", now, True, "error", reason, now))


class _Feed:
    """This client's event stream from one replica (one message per engine step), read on a
    background thread and fanned out to each request's sink. A stream the replica ended (idle
    too long) is reopened while requests are in flight; one that breaks hands its requests to
    the client to move. It holds the client weakly, so a dropped client is collected (and its
    streams closed) even while this thread waits."""

    def __init__(self, client: Client, handle, subscriber: str, replica_id: str):
        self.flights: dict[str, _Flight] = {}
        self.lock = threading.Lock()
        self.dead = False
        self._client = weakref.ref(client)
        self._handle = handle
        self._subscriber = subscriber
        self._replica_id = replica_id
        self._gen = handle.events.remote(subscriber)
        threading.Thread(target=self._read, daemon=True, name=f"slotserve-feed-{replica_id}").start()

    def add(self, flight: _Flight) -> bool:
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
            client = self._client()
            if client is None or not ray.is_initialized() or not flights:
                return
            if _replica_gone(err):
                client._replica_lost(self._replica_id, flights, f"{type(err).__name__}: {str(err)[:200]}")
            else:  # e.g. OverloadedError: too many client streams there; the requests go elsewhere
                client._relocate(flights, self._replica_id, f"stream refused: {_unwrap(err)}")

    def _dispatch(self, batch: list[StreamEvent], now: float) -> None:
        moved, why = [], "replica draining"
        for event in batch:
            flight = self.flights.get(event.request_id)
            if flight is None:  # an aborted or refused request: its last events are dropped
                continue
            if event.finished:
                with self.lock:
                    self.flights.pop(event.request_id, None)
                    if event.finish_reason == "migrate":  # handed back: it goes on elsewhere
                        why = event.error or why
                        if flight.placing:
                            flight.handed_back = True  # its placer moves it
                        else:
                            moved.append(flight)
                        continue
            flight.token_ids += event.token_ids
            flight.text += event.text
            flight.sink(event.stamped(now))
        if moved and (client := self._client()) is not None:
            client._relocate(moved, self._replica_id, why)


def _close_streams(replicas: dict, feeds: dict, subscriber: str) -> None:
    """End this client's streams on every replica it used (at close, collection or exit)."""
    if not ray.is_initialized():
        return
    for replica_id in list(feeds):
        try:
            replicas[replica_id].close_events.remote(subscriber)
        except Exception:  # noqa: BLE001, S110 - best effort: the replica ends idle streams on its own
            pass
    feeds.clear()


def _engine_block_size(replicas: dict) -> int:
    """The replicas' K/V block size (one config for all), which block hashes are taken at."""
    for handle in replicas.values():
        try:
            return ray.get(handle.info.remote(), timeout=10)["config"]["engine"]["block_size"]
        except Exception:  # noqa: BLE001, S112 - a replica down now: ask the next
            continue
    return EngineConfig().block_size


class Client:
    def __init__(self, address: str | None = None, routing: str = "actor"):
        """`routing="local"` runs the router's policy inside this client, fed by the router
        actor's load reports (`cluster.local_routing`); "actor" asks the router actor."""
        if routing not in ROUTING_MODES:
            raise InvalidRequestError("routing", f"must be one of {', '.join(ROUTING_MODES)}; got {routing!r:.80}")
        connect(address)
        self.router = router_handle()
        self._replicas: dict = self._router_call(lambda r: r.replicas.remote(), timeout=60)
        self.block_size = _engine_block_size(self._replicas)
        self._local = LocalRouter(self.router, list(self._replicas)) if routing == "local" else None
        self.subscriber = f"client-{uuid.uuid4().hex[:12]}"
        self._feeds: dict[str, _Feed] = {}
        self._feeds_lock = threading.Lock()
        self._routes: list[tuple[tuple, asyncio.Future]] = []  # routed this event-loop turn, not yet sent
        # Streams close when the client is closed, collected, or the process exits.
        self._finalizer = weakref.finalize(self, _close_streams, self._replicas, self._feeds, self.subscriber)

    def close(self) -> None:
        """End this client's event streams on every replica it used (and abort its requests there)."""
        if self._local is not None:
            self._local.close()
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the router, with retries while Ray restarts it ------------------------------------
    def _router_call(self, call: Callable, timeout: float = 30.0):
        """`call(router)` and its result; while the router is dead or restarting, retried with
        backoff for ROUTER_RETRY_SECONDS (looking it up again, in case `up` replaced it)."""
        deadline, delay = time.monotonic() + ROUTER_RETRY_SECONDS, 0.1
        while True:
            try:
                return ray.get(call(self.router), timeout=timeout)
            except ray.exceptions.RayTaskError as err:
                raise _unwrap(err) from None
            except ray.exceptions.GetTimeoutError:
                raise ClusterError(f"the slotserve router did not answer within {timeout:g} s") from None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
                if time.monotonic() > deadline:
                    raise ClusterError(f"the slotserve router is unreachable: {err}") from None
            time.sleep(delay)
            delay = min(2.0, delay * 2)
            try:
                self.router = router_handle()
            except ClusterError:
                pass

    # ---- submission ---------------------------------------------------------------------
    def _prepare(self, prompt, session_id, request_id, params: dict, sink: Sink) -> _Flight:
        """Validate (failing fast, before routing) and stamp arrival."""
        validate_prompt(prompt)
        if session_id is not None and (not isinstance(session_id, str) or len(session_id) > 256):
            raise InvalidRequestError(
                "session_id", f"must be a string of at most 256 characters, got {session_id!r:.80}"
            )
        sampling = SamplingParams.parse(params)
        rid = validate_request_id(request_id) if request_id is not None else uuid.uuid4().hex
        prompt_len = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)  # no tokenizer here
        hashes = tuple(block_hashes(prompt, self.block_size)) if isinstance(prompt, list) else ()
        result = Result(rid, None, time.time())
        flight = _Flight(result, prompt, sampling, session_id, sink, prompt_len, block_hashes=hashes)
        flight.block_size = self.block_size
        if self._local is not None:  # the local router hears of the end (and the output length) here
            flight.sink = partial(self._local_sink, flight, sink)
        return flight

    def _local_sink(self, flight: _Flight, sink: Sink, event: StreamEvent) -> None:
        if event.finished:  # the feed has added its tokens to the flight already
            natural = event.finish_reason in ("eos", "stop", "length")
            self._local.complete(flight.request_id, len(flight.token_ids) if natural else None, event.replica_id)
        sink(event)

    def _route_many(self, routes: list[tuple]) -> list:
        """One answer per route (a replica id or the error that refused it), from the local
        router or the router actor."""
        if self._local is not None:
            return self._local.route_many(routes)
        return self._router_call(lambda r: r.route_many.remote(routes))

    def _feed(self, replica_id: str, flight: _Flight) -> None:
        """Put the flight on this client's stream from the replica, opening one if needed."""
        flight.placing, flight.handed_back = True, False
        with self._feeds_lock:
            if replica_id not in self._replicas:
                self._replicas.update(self._router_call(lambda r: r.replicas.remote()))
            feed = self._feeds.get(replica_id)
            if feed is None or not feed.add(flight):
                feed = self._feeds[replica_id] = _Feed(self, self._replicas[replica_id], self.subscriber, replica_id)
                feed.add(flight)
        flight.feed = feed
        flight.replica_id = flight.result.replica_id = replica_id

    @staticmethod
    def _settle(flight: _Flight) -> bool:
        """The replica accepted the flight: hand it to its feed. True when it must move again
        at once: the feed broke meanwhile, or the replica already handed it back."""
        feed = flight.feed
        with feed.lock:
            flight.placing = False
            again = feed.dead or flight.handed_back
            if again:
                feed.flights.pop(flight.request_id, None)
        return again

    def _unfeed(self, flight: _Flight) -> None:
        """The flight left its replica unfinished (aborted, or refused there): stop reading it."""
        feed = flight.feed
        if feed is not None:
            with feed.lock:
                feed.flights.pop(flight.request_id, None)
        if self._local is not None:
            self._local.complete(flight.request_id, None, flight.replica_id)

    def _submit(self, flight: _Flight, replica_id: str):
        self._feed(replica_id, flight)
        return self._replicas[replica_id].submit.remote(
            self.subscriber,
            flight.prompt,
            flight.sampling.model_dump(),
            flight.request_id,
            flight.result.arrival,
            flight.resume(),
        )

    def _place(self, flight: _Flight) -> None:
        """Place a new request; raises the typed error that refused it."""
        for _, err in self._place_all([flight], None):
            raise err

    def _place_all(self, flights: list[_Flight], moved_from: str | None) -> list[tuple[_Flight, SlotServeError]]:
        """Route and submit the flights (one route call per round for all of them), going on
        past replicas that are dead or draining, at most MAX_ATTEMPTS placements of a
        request in all. Returns the ones refused, each with the typed error that refused it."""
        failed: list[tuple[_Flight, SlotServeError]] = []
        todo = [(flight, moved_from) for flight in flights]
        while todo:
            for flight, _ in todo:
                flight.attempts += 1
            failed += [
                (f, RequestLostError(f.request_id, MAX_ATTEMPTS, f"the last replica tried was {m}"))
                for f, m in todo
                if f.attempts > MAX_ATTEMPTS
            ]
            todo = [(f, m) for f, m in todo if f.attempts <= MAX_ATTEMPTS]
            if not todo:
                break
            answers = self._route_many([f.route(m) for f, m in todo])
            submitted = []
            for (flight, _), answer in zip(todo, answers):
                if isinstance(answer, Exception):
                    failed.append((flight, _unwrap(answer)))
                else:
                    submitted.append((flight, answer, self._submit(flight, answer)))
            todo, lost = [], set()
            for flight, replica_id, ref in submitted:
                try:
                    ray.get(ref, timeout=120)
                    if self._settle(flight):
                        todo.append((flight, replica_id))
                except Exception as err:  # noqa: BLE001 - sorted below
                    self._unfeed(flight)
                    if _replica_gone(err):
                        if replica_id not in lost:
                            lost.add(replica_id)
                            self._tell_lost(replica_id, type(err).__name__)
                        todo.append((flight, replica_id))
                    elif isinstance(_unwrap(err), DrainingError):
                        todo.append((flight, replica_id))
                    else:
                        failed.append((flight, _unwrap(err)))
        return failed

    def _tell_lost(self, replica_id: str, reason: str) -> None:
        if self._local is not None:
            self._local.replica_lost(replica_id, reason)
        try:
            self._router_call(lambda r: r.replica_lost.remote(replica_id, reason), timeout=10)
        except SlotServeError:
            pass  # the router's own health check finds it

    def _replica_lost(self, replica_id: str, flights: list[_Flight], reason: str) -> None:
        """A replica's stream broke: tell the router, then move its requests (feed thread)."""
        self._tell_lost(replica_id, reason)
        self._relocate(flights, replica_id, f"replica {replica_id} lost: {reason}")

    def _relocate(self, flights: list[_Flight], from_replica: str, reason: str) -> None:
        """Place the requests again, each with the tokens it delivered; one that cannot be
        placed ends with an error event naming why. Runs on a feed's thread."""
        carried = {flight.request_id: len(flight.token_ids) for flight in flights}
        failed = dict((flight.request_id, err) for flight, err in self._place_all(flights, from_replica))
        now = time.time()
        for flight in flights:
            err = failed.get(flight.request_id)
            if err is not None:
                flight.end(from_replica, f"{reason}; not resumed: {err}")
            to = None if err is not None else flight.replica_id
            flight.result.migrations.append(
                MigrationRecord(flight.request_id, from_replica, to, carried[flight.request_id], reason, now)
            )

    def _abort(self, flight: _Flight) -> None:
        self._unfeed(flight)
        if flight.replica_id is not None:
            self._replicas[flight.replica_id].abort.remote(self.subscriber, flight.request_id)

    def _sync_events(self, prompt, session_id, request_id, params, timeout) -> tuple[Result, Iterator[StreamEvent]]:
        events: queue.Queue[StreamEvent] = queue.Queue()
        flight = self._prepare(prompt, session_id, request_id, params, events.put)
        self._place(flight)
        return flight.result, self._drain(flight, events, timeout)

    def _drain(self, flight: _Flight, events: queue.Queue, timeout: float | None) -> Iterator[StreamEvent]:
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = False
        try:
            while not finished:
                try:
                    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                    event = events.get(timeout=wait)
                except queue.Empty:
                    raise self._timed_out(flight, timeout) from None
                flight.result.add(event)
                finished = event.finished
                yield event
        finally:
            if not finished:  # the caller stopped reading or timed out: stop the replica computing for it
                self._abort(flight)

    @staticmethod
    def _timed_out(flight: _Flight, timeout: float) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"request {flight.request_id!r} did not finish within timeout={timeout:g} s "
            f"({len(flight.result.token_ids)} tokens received); aborted on {flight.replica_id}"
        )

    async def _async_events(self, prompt, session_id, request_id, params, timeout):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        flight = self._prepare(
            prompt, session_id, request_id, params, lambda e: loop.call_soon_threadsafe(events.put_nowait, e)
        )
        await self._aplace(flight)
        return flight.result, self._adrain(flight, events, timeout)

    async def _aplace(self, flight: _Flight) -> None:
        """The first placement through the batched route (`_aroute`); a dead or draining
        replica, or a router Ray is restarting, sends it on through `_place_all` in a thread."""
        flight.attempts += 1
        try:
            answer = await self._aroute(flight.route(None))
        except Exception as err:  # noqa: BLE001 - sorted below
            if not _replica_gone(err):
                raise _unwrap(err) from None
            flight.attempts -= 1
            await asyncio.to_thread(self._place, flight)
            return
        try:
            await self._submit(flight, answer)
            if not self._settle(flight):
                return
        except Exception as err:  # noqa: BLE001 - sorted below
            self._unfeed(flight)
            if _replica_gone(err):
                await asyncio.to_thread(self._tell_lost, answer, type(err).__name__)
            elif not isinstance(_unwrap(err), DrainingError):
                raise _unwrap(err) from None
        for _, refused in await asyncio.to_thread(self._place_all, [flight], answer):
            raise refused

    async def _aroute(self, route: tuple) -> str:
        """Ask the router, sending every request routed in the same event-loop turn (a burst
        of arrivals) in one call: a Ray call costs far more than a routing decision. Each
        request gets its own answer, so a refused one fails alone. A local router answers at once."""
        if self._local is not None:
            answer = self._local.route_many([route])[0]
            if isinstance(answer, SlotServeError):
                raise answer
            return answer
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._routes.append((route, future))
        if len(self._routes) == 1:
            loop.call_soon(self._send_routes)
        return await future

    def _send_routes(self) -> None:
        batch, self._routes = self._routes, []
        ref = self.router.route_many.remote([route for route, _ in batch])

        def settle(done: asyncio.Future) -> None:
            try:
                answers = done.result()
            except BaseException as err:  # noqa: BLE001 - every waiting request gets the error
                answers = [err] * len(batch)
            for (_, future), answer in zip(batch, answers):
                if not future.done():
                    if isinstance(answer, BaseException):
                        future.set_exception(_unwrap(answer) if isinstance(answer, SlotServeError) else answer)
                    else:
                        future.set_result(answer)

        asyncio.ensure_future(ref).add_done_callback(settle)

    async def _adrain(self, flight: _Flight, events: asyncio.Queue, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = False
        try:
            while not finished:
                try:
                    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                    event = await asyncio.wait_for(events.get(), wait)
                except TimeoutError:
                    raise self._timed_out(flight, timeout) from None
                flight.result.add(event)
                finished = event.finished
                yield event
        finally:
            if not finished:  # cancelled, timed out or left: stop the replica computing for it
                self._abort(flight)

    # ---- the API --------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | list[int],
        session_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **params,
    ) -> Iterator[StreamEvent]:
        """Yield events as tokens arrive; the last has finished=True and the finish reason.
        Past `timeout` seconds the request is aborted and RequestTimeoutError raised."""
        yield from self._sync_events(prompt, session_id, request_id, params, timeout)[1]

    def generate(
        self,
        prompt: str | list[int],
        session_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **params,
    ) -> Result:
        result, events = self._sync_events(prompt, session_id, request_id, params, timeout)
        for _ in events:
            pass
        return result

    async def astream(
        self,
        prompt: str | list[int],
        session_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **params,
    ) -> AsyncIterator[StreamEvent]:
        _, events = await self._async_events(prompt, session_id, request_id, params, timeout)
        async for event in events:
            yield event

    async def agenerate(
        self,
        prompt: str | list[int],
        session_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **params,
    ) -> Result:
        result, events = await self._async_events(prompt, session_id, request_id, params, timeout)
        async for _ in events:
            pass
        return result
