"""The Python client: submit requests to a running slotserve cluster and stream the tokens.

`Client.generate` blocks, `Client.stream` yields tokens as the replica makes them, and the
`a`-prefixed versions do the same under asyncio. The client asks the router which replica
to use, then reads the tokens from that replica directly: the router is never on the
per-token path. It stamps arrival, first token and every token time on its own clock.
"""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import ray

from replica.errors import SlotServeError
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
        raise ClusterError(f"cannot reach a Ray cluster at {address!r} ({err}); "
                           "start one with `ray start --head` or give its HOST:PORT") from None


def connect(address: str | None = None) -> None:
    """Join the Ray cluster at `address`, or the one `ray start` made on this machine."""
    if ray.is_initialized():
        return
    if address not in (None, "auto"):
        _check_reachable(address)
    try:
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as err:
        raise ClusterError(f"no Ray cluster running{'' if address in (None, 'auto') else ' at ' + address}: "
                           f"start one with `ray start --head` or `slotserve up` ({err})") from None


def router_handle():
    try:
        return ray.get_actor(ROUTER_ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ClusterError("no slotserve router on this Ray cluster: start one with `slotserve up`") from None


@dataclass
class StreamEvent:
    token_ids: list[int]
    text: str
    time: float  # when the client received it
    made: float  # when the replica made it (the replica's clock)
    finished: bool
    finish_reason: str | None
    error: str | None
    replica_id: str


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


def _unwrap(err: Exception) -> Exception:
    """A replica's typed error (e.g. InvalidRequestError) instead of Ray's wrapper around it."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, SlotServeError) else ClusterError(f"request failed in the cluster: {err}")


class Client:
    def __init__(self, address: str | None = None):
        connect(address)
        self.router = router_handle()
        self._replicas: dict = ray.get(self.router.replicas.remote(), timeout=60)

    def _start(self, prompt: str | list[int], session_id: str | None, request_id: str | None, params: dict):
        """Validate, route, and start the replica's token stream."""
        sampling = SamplingParams.parse(params)  # fail fast on bad parameters, before routing
        arrival = time.time()
        rid = request_id or uuid.uuid4().hex
        prompt_len = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)  # estimate: no tokenizer here
        replica_id = ray.get(self.router.route.remote(rid, prompt_len, sampling.max_tokens, session_id))
        if replica_id not in self._replicas:
            self._replicas = ray.get(self.router.replicas.remote())
        gen = self._replicas[replica_id].generate.remote(prompt, sampling.model_dump(), rid, arrival)
        return Result(rid, replica_id, arrival), gen

    @staticmethod
    def _event(raw: dict) -> StreamEvent:
        return StreamEvent(raw["token_ids"], raw["text"], time.time(), raw["time"], raw["finished"],
                           raw["finish_reason"], raw["error"], raw["replica_id"])

    def stream(self, prompt: str | list[int], session_id: str | None = None, request_id: str | None = None,
               **params) -> Iterator[StreamEvent]:
        """Yield events as tokens arrive; the last has finished=True and the finish reason."""
        yield from self._events(*self._start(prompt, session_id, request_id, params))

    def generate(self, prompt: str | list[int], session_id: str | None = None, request_id: str | None = None,
                 **params) -> Result:
        result, gen = self._start(prompt, session_id, request_id, params)
        for _ in self._events(result, gen):
            pass
        return result

    async def astream(self, prompt: str | list[int], session_id: str | None = None, request_id: str | None = None,
                      **params) -> AsyncIterator[StreamEvent]:
        async for event in self._aevents(*self._start(prompt, session_id, request_id, params)):
            yield event

    async def agenerate(self, prompt: str | list[int], session_id: str | None = None, request_id: str | None = None,
                        **params) -> Result:
        result, gen = self._start(prompt, session_id, request_id, params)
        async for _ in self._aevents(result, gen):
            pass
        return result

    def _events(self, result: Result, gen) -> Iterator[StreamEvent]:
        try:
            for ref in gen:
                event = self._event(ray.get(ref))
                result.add(event)
                yield event
        except ray.exceptions.RayError as err:
            raise _unwrap(err) from None

    async def _aevents(self, result: Result, gen) -> AsyncIterator[StreamEvent]:
        try:
            async for ref in gen:
                event = self._event(await ref)
                result.add(event)
                yield event
        except ray.exceptions.RayError as err:
            raise _unwrap(err) from None
