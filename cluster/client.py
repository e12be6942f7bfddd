"""The Python client: submit requests to a running slotserve cluster and stream the tokens.

`Client.astream` yields tokens as the replica makes them and `Client.agenerate` waits for the
end, under asyncio; `Client.stream` and `Client.generate` are the same, blocking: they run the
async core on the client's own event loop (`cluster.loop_thread`). The client asks the router
which replica to use, submits there, and reads the tokens from that replica directly: the
router is never on the per-token path. Each replica sends this client one message per engine
step with all of its requests' new tokens. The client stamps arrival and every token's
receipt on its own clock.

Nothing accepted is lost when a replica goes: the client keeps what each request in flight
has delivered, and moves it to another replica with those tokens to prefill after the prompt
(`cluster.placement`), so the caller's stream goes on with no gap and no duplicate. The pieces:
`cluster.connection` (joining Ray, finding the router), `cluster.streams` (a request's
`Result`, what the client keeps of it in flight, a replica's event stream), `cluster.placement`
(routing, submitting and moving), `cluster.local_routing` (`Client(routing="local")`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing
from functools import partial

import ray

from cluster.connection import NAMESPACE, ClusterError, connect, router_handle
from cluster.local_routing import ROUTING_MODES, LocalRouter
from cluster.loop_thread import LoopThread
from cluster.placement import MAX_ATTEMPTS, MOVE_WAIT_SECONDS, ROUTER_RETRY_SECONDS, Placer
from cluster.streams import Flight, Result, Sink
from protocol import defaults
from protocol.blocks import block_hashes
from protocol.errors import RequestLostError
from protocol.messages import StreamEvent
from replica.config import EngineConfig
from replica.errors import InvalidRequestError
from replica.scheduling.request import SamplingParams, validate_prompt, validate_request_id

__all__ = [
    "MAX_ATTEMPTS",
    "MOVE_WAIT_SECONDS",
    "NAMESPACE",
    "ROUTER_RETRY_SECONDS",
    "Client",
    "ClusterError",
    "RequestLostError",
    "RequestTimeoutError",
    "Result",
    "connect",
    "router_handle",
]


class RequestTimeoutError(ClusterError, TimeoutError):
    """The request did not finish within the caller's `timeout`; it was aborted on its replica."""


def _engine_block_size(replicas: dict) -> int:
    """The replicas' K/V block size (one config for all), which block hashes are taken at."""
    for handle in replicas.values():
        try:
            return ray.get(handle.info.remote(), timeout=10).block_size
        except Exception:  # noqa: BLE001, S112 - a replica down now: ask the next
            continue
    return EngineConfig().block_size


class Client:
    """Requests to a running cluster. `**params` of every call are `SamplingParams` fields
    (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`, ...) with its defaults:
    temperature 0, greedy, as the CLI's (over HTTP a request without one samples at 1.0,
    OpenAI's default). `priority` is one of them too (lower is served first, by the router's
    flow control and by the replica's scheduler), and `tenant` names whose traffic it is, for
    the router's fair shares and limits (`protocol.flow`)."""

    def __init__(self, address: str | None = None, routing: str = "actor"):
        """`routing="local"` runs the router's policy inside this client, fed by the router
        actor's load reports (`cluster.local_routing`); "actor" asks the router actor."""
        if routing not in ROUTING_MODES:
            raise InvalidRequestError("routing", f"must be one of {', '.join(ROUTING_MODES)}; got {routing!r:.80}")
        connect(address)
        self.subscriber = f"client-{uuid.uuid4().hex[:12]}"
        self._loop = LoopThread(f"slotserve-{self.subscriber}")
        try:
            self._placer = Placer(self._loop, self.subscriber, local_routing=routing == "local")
        except BaseException:
            self._loop.stop()
            raise
        self.block_size = _engine_block_size(self._placer.replicas)
        # Streams close when the client is closed, collected, or the process exits.
        self._finalizer = weakref.finalize(self, self._placer.close)

    @property
    def router(self):
        """The router actor's handle (looked up again when Ray restarted it)."""
        return self._placer.router

    @property
    def local_router(self) -> LocalRouter | None:
        """The router inside this client (`routing="local"`), else None."""
        return self._placer.local

    def close(self) -> None:
        """End this client's event streams on every replica it used (and abort its requests there)."""
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the async core -------------------------------------------------------------------
    def _prepare(
        self, prompt, session_id, request_id, params: dict, sink: Sink, timeout: float | None, tenant: str | None
    ) -> Flight:
        """Validate (failing fast, before routing) and stamp arrival."""
        validate_prompt(prompt)
        if tenant is not None and (not isinstance(tenant, str) or not tenant or len(tenant) > 256):
            raise InvalidRequestError(
                "tenant", f"must be a non-empty string of at most 256 characters, got {tenant!r:.80}"
            )
        if session_id is not None and (not isinstance(session_id, str) or len(session_id) > 256):
            raise InvalidRequestError(
                "session_id", f"must be a string of at most 256 characters, got {session_id!r:.80}"
            )
        sampling = SamplingParams.parse(params)
        rid = validate_request_id(request_id) if request_id is not None else uuid.uuid4().hex
        prompt_len = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)  # no tokenizer here
        hashes = tuple(block_hashes(prompt, self.block_size)) if isinstance(prompt, list) else ()
        result = Result(rid, None, time.time())
        flight = Flight(
            result, prompt, sampling, session_id, sink, prompt_len, tenant or defaults.TENANT, block_hashes=hashes
        )
        flight.block_size = self.block_size
        flight.deadline = None if timeout is None else time.monotonic() + timeout
        flight.sink = self._placer.local_sink(flight, sink)  # a local router hears of the end here
        return flight

    async def _open(self, prompt, session_id, request_id, params, timeout, tenant) -> tuple[Result, AsyncGenerator]:
        """Place the request; its result and the stream of its events."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        sink = partial(loop.call_soon_threadsafe, events.put_nowait)
        flight = self._prepare(prompt, session_id, request_id, params, sink, timeout, tenant)
        try:
            await self._placer.place(flight)
        except asyncio.CancelledError:  # its caller left while it was placed: nothing may run for it
            self._placer.abort(flight)
            raise
        return flight.result, self._events(flight, events, timeout)

    async def _events(self, flight: Flight, events: asyncio.Queue, timeout: float | None) -> AsyncGenerator:
        finished = False
        try:
            while not finished:
                try:
                    if flight.deadline is None:  # no timer: wait_for would cost a task per event
                        event = await events.get()
                    else:
                        event = await asyncio.wait_for(events.get(), max(0.0, flight.deadline - time.monotonic()))
                except TimeoutError:
                    raise RequestTimeoutError(
                        f"request {flight.request_id!r} did not finish within timeout={timeout:g} s "
                        f"({len(flight.result.token_ids)} tokens received); aborted on {flight.replica_id}"
                    ) from None
                flight.result.add(event)
                finished = event.finished
                yield event
        finally:
            if not finished:  # cancelled, timed out or left: stop the replica computing for it
                self._placer.abort(flight)

    # ---- the API --------------------------------------------------------------------------
    async def astream(
        self,
        prompt: str | list[int],
        session_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        tenant: str | None = None,
        **params,
    ) -> AsyncIterator[StreamEvent]:
        """Yield events as tokens arrive; the last has finished=True and the finish reason.
        Past `timeout` seconds the request is aborted and RequestTimeoutError raised (held by
        flow control that long, it is refused at the router: OverloadedError)."""
        _, events = await self._open(prompt, session_id, request_id, params, timeout, tenant)
        async with aclosing(events):
            async for event in events:
                yield event

    async def agenerate(
        self,
        prompt: str | list[int],
        session_id: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        tenant: str | None = None,
        **params,
    ) -> Result:
        """The whole request (as `astream`), once it has ended."""
        result, events = await self._open(prompt, session_id, request_id, params, timeout, tenant)
        async with aclosing(events):
            async for _ in events:
                pass
        return result

    def stream(self, *args, **kwargs) -> Iterator[StreamEvent]:
        """`astream` (the same arguments), blocking."""
        yield from self._loop.iterate(self.astream(*args, **kwargs))

    def generate(self, *args, **kwargs) -> Result:
        """`agenerate` (the same arguments), blocking."""
        return self._loop.run(self.agenerate(*args, **kwargs))
