"""The Python client: submit requests to a running slotserve cluster and stream the tokens.

`Client.generate` blocks, `Client.stream` yields tokens as the replica makes them, and the
`a`-prefixed versions do the same under asyncio. The client asks the router which replica
to use, submits there, and reads the tokens from that replica directly: the router is never
on the per-token path. Each replica sends this client one message per engine step with all
of its requests' new tokens. The client stamps arrival and every token's receipt on its own
clock.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import ray

from metrics.definitions import RequestTrace
from protocol.errors import SlotServeError
from protocol.messages import StreamEvent
from replica.request import SamplingParams
from router.actor import ROUTER_ACTOR_NAME

NAMESPACE = "slotserve"


class ClusterError(SlotServeError):
    """No cluster where one was expected, or the cluster failed a request."""


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

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    def add(self, event: StreamEvent) -> None:
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
    """A replica's typed error (e.g. InvalidRequestError) instead of Ray's wrapper around it."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, SlotServeError) else ClusterError(f"request failed in the cluster: {err}")


Sink = Callable[[StreamEvent], None]


class _Feed:
    """This client's event stream from one replica (one message per engine step), read on a
    background thread and fanned out to each request's sink."""

    def __init__(self, handle, subscriber: str, replica_id: str):
        self.sinks: dict[str, Sink] = {}
        self._gen = handle.events.remote(subscriber)
        self._replica_id = replica_id
        threading.Thread(target=self._read, daemon=True, name=f"slotserve-feed-{replica_id}").start()

    def _read(self) -> None:
        try:
            for ref in self._gen:
                if not ray.is_initialized():  # the driver shut Ray down under us: stop quietly
                    return
                batch, now = ray.get(ref), time.time()
                for event in batch:
                    # An aborted or refused request's sink is gone already: its final event is dropped.
                    rid = event.request_id
                    sink = self.sinks.pop(rid, None) if event.finished else self.sinks.get(rid)
                    if sink is not None:
                        sink(event.stamped(now))
        except Exception as err:  # noqa: BLE001 - the replica died or Ray went away: its requests end with an error
            for rid, sink in list(self.sinks.items()):
                now = time.time()
                sink(StreamEvent(rid, self._replica_id, [], "", now, True, "error", f"replica lost: {err}", now))
            self.sinks.clear()


class Client:
    def __init__(self, address: str | None = None):
        connect(address)
        self.router = router_handle()
        self._replicas: dict = ray.get(self.router.replicas.remote(), timeout=60)
        self.subscriber = f"client-{uuid.uuid4().hex[:12]}"
        self._feeds: dict[str, _Feed] = {}
        self._routes: list[tuple[tuple, asyncio.Future]] = []  # routed this event-loop turn, not yet sent

    def close(self) -> None:
        """End this client's event streams on every replica it used."""
        for replica_id in self._feeds:
            self._replicas[replica_id].close_events.remote(self.subscriber)
        self._feeds.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- submission ---------------------------------------------------------------------
    def _prepare(self, prompt: str | list[int], session_id: str | None, request_id: str | None, params: dict):
        """Validate (failing fast, before routing), stamp arrival, and say what the router needs."""
        sampling = SamplingParams.parse(params)
        arrival = time.time()
        rid = request_id or uuid.uuid4().hex
        prompt_len = (
            len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)
        )  # estimate: no tokenizer here
        return Result(rid, None, arrival), sampling, (rid, prompt_len, sampling.max_tokens, session_id)

    async def _aroute(self, route: tuple) -> str:
        """Ask the router, sending every request routed in the same event-loop turn (a burst
        of arrivals) in one call: a Ray call costs far more than a routing decision."""
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
                replica_ids = done.result()
            except BaseException as err:  # noqa: BLE001 - every waiting request gets the error
                replica_ids, error = [None] * len(batch), err
            else:
                error = None
            for (_, future), replica_id in zip(batch, replica_ids):
                if not future.done():
                    if error is None:
                        future.set_result(replica_id)
                    else:
                        future.set_exception(error)

        asyncio.ensure_future(ref).add_done_callback(settle)

    def _submit(self, prompt: str | list[int], result: Result, sampling: SamplingParams, replica_id: str, sink: Sink):
        """Register the sink on the chosen replica's feed, then submit there."""
        if replica_id not in self._replicas:
            self._replicas = ray.get(self.router.replicas.remote())
        handle = self._replicas[replica_id]
        if replica_id not in self._feeds:
            self._feeds[replica_id] = _Feed(handle, self.subscriber, replica_id)
        result.replica_id = replica_id
        self._feeds[replica_id].sinks[result.request_id] = sink
        return handle.submit.remote(self.subscriber, prompt, sampling.model_dump(), result.request_id, result.arrival)

    def _refused(self, result: Result, err: Exception) -> Exception:
        if result.replica_id in self._feeds:
            self._feeds[result.replica_id].sinks.pop(result.request_id, None)
        return _unwrap(err)

    def _abort(self, result: Result) -> None:
        self._feeds[result.replica_id].sinks.pop(result.request_id, None)
        self._replicas[result.replica_id].abort.remote(result.request_id)

    def _sync_events(self, prompt, session_id, request_id, params) -> tuple[Result, Iterator[StreamEvent]]:
        events: queue.Queue[StreamEvent] = queue.Queue()
        result, sampling, route = self._prepare(prompt, session_id, request_id, params)
        try:
            ray.get(self._submit(prompt, result, sampling, ray.get(self.router.route.remote(*route)), events.put))
        except ray.exceptions.RayError as err:
            raise self._refused(result, err) from None
        return result, self._drain(result, events)

    def _drain(self, result: Result, events: queue.Queue) -> Iterator[StreamEvent]:
        finished = False
        try:
            while not finished:
                event = events.get()
                result.add(event)
                finished = event.finished
                yield event
        finally:
            if not finished:  # the caller stopped reading: stop the replica computing for it
                self._abort(result)

    async def _async_events(self, prompt, session_id, request_id, params) -> tuple[Result, AsyncIterator[StreamEvent]]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        result, sampling, route = self._prepare(prompt, session_id, request_id, params)
        sink = partial(loop.call_soon_threadsafe, events.put_nowait)
        try:
            await self._submit(prompt, result, sampling, await self._aroute(route), sink)
        except ray.exceptions.RayError as err:
            raise self._refused(result, err) from None
        return result, self._adrain(result, events)

    async def _adrain(self, result: Result, events: asyncio.Queue) -> AsyncIterator[StreamEvent]:
        finished = False
        try:
            while not finished:
                event = await events.get()
                result.add(event)
                finished = event.finished
                yield event
        finally:
            if not finished:
                self._abort(result)

    # ---- the API --------------------------------------------------------------------------
    def stream(
        self, prompt: str | list[int], session_id: str | None = None, request_id: str | None = None, **params
    ) -> Iterator[StreamEvent]:
        """Yield events as tokens arrive; the last has finished=True and the finish reason."""
        yield from self._sync_events(prompt, session_id, request_id, params)[1]

    def generate(
        self, prompt: str | list[int], session_id: str | None = None, request_id: str | None = None, **params
    ) -> Result:
        result, events = self._sync_events(prompt, session_id, request_id, params)
        for _ in events:
            pass
        return result

    async def astream(
        self, prompt: str | list[int], session_id: str | None = None, request_id: str | None = None, **params
    ) -> AsyncIterator[StreamEvent]:
        _, events = await self._async_events(prompt, session_id, request_id, params)
        async for event in events:
            yield event

    async def agenerate(
        self, prompt: str | list[int], session_id: str | None = None, request_id: str | None = None, **params
    ) -> Result:
        result, events = await self._async_events(prompt, session_id, request_id, params)
        async for _ in events:
            pass
        return result
