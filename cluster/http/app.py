"""The OpenAI-compatible HTTP API (FastAPI): `/v1/completions`, `/v1/chat/completions`
(streamed as server-sent events or not), `/v1/models`, `/health` and `/metrics`.

Every route but `/health` checks the API key when one is set. Errors are OpenAI's JSON shape
with the status that says whose fault it is (400 bad input naming the field, 401 key, 404
model, 429/503 with Retry-After when the cluster is overloaded or unavailable, 500 only for
bugs). A streamed request's status comes with its first token, so a refusal is still a
proper HTTP error; after that each engine step's tokens go out as one chunk, one write. A
client that disconnects, streaming or not, has its request aborted on the replica at once:
the response listens for the disconnect instead of waiting to fail on the next write.

A refused bad request (400, 404 for another model) is recorded in the serve run as `invalid`,
with its status, apart from `rejected` (429: overload) and `error` (the cluster failed).

`/metrics` serves this ingress's own Prometheus metrics (requests by route and status, in
flight, tokens, and latency histograms as the client sees them: time to first token and
end-to-end, in the replicas' buckets); the replicas' and router's metrics are Ray's, on each
node's metrics port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.http.ingress import Ingress, Prepared
from cluster.http.openai_protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    ResponseShape,
    openai_finish_reason,
    sse,
    usage,
)
from metrics.live import LATENCY_BUCKETS
from protocol.messages import StreamEvent

SESSION_HEADER = "x-session-id"  # the session id when the body gives no `user`
PRIORITY_HEADER = "x-priority"  # the request's priority when the body gives no `priority`
GENERATION_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
DESCRIPTION = (
    "OpenAI-compatible API of a slotserve cluster. Sampling defaults are OpenAI's: `temperature` 1.0 "
    "and `top_p` 1.0 when a request leaves them out (the `slotserve` CLI and the Python client default "
    "to temperature 0, greedy). A refused bad request is recorded in the serve run as `invalid`."
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) as soon as the client hangs up."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise ClientGone()
    return task.result()


class EventStream(StreamingResponse):
    """A stream that stops the moment the client disconnects (it always listens for the
    disconnect, whatever ASGI version the server speaks) and then runs `close`, which aborts
    the request if it is still running, even if the body never started."""

    def __init__(self, content: AsyncIterator[str], close: Callable[[], Awaitable[None]]):
        super().__init__(content, media_type="text/event-stream")
        self.close = close

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watch):
                task.cancel()
            try:
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await stream
            finally:
                await self.close()


class IngressMetrics:
    """This ingress's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "slotserve_http_requests", "HTTP requests answered", ["route", "status"], registry=self.registry
        )
        self.in_flight = Gauge("slotserve_http_requests_in_flight", "requests being answered", registry=self.registry)
        self.prompt_tokens = Counter("slotserve_http_prompt_tokens", "prompt tokens", registry=self.registry)
        self.generation_tokens = Counter("slotserve_http_generation_tokens", "tokens made", registry=self.registry)
        self.ttft = Histogram(
            "slotserve_http_time_to_first_token_seconds",
            "arrival at the ingress to the first token's event, of requests answered",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "slotserve_http_e2e_request_latency_seconds",
            "arrival at the ingress to the last token's event, of requests answered",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )


def create_app(ingress: Ingress, api_key: str | None = None, tenant_keys: dict[str, str] | None = None) -> FastAPI:
    """`api_key` and each of `tenant_keys` (key -> the flow-control tenant it authenticates as)
    open every route but /health; with neither, every route is open."""
    app = FastAPI(title="slotserve", description=DESCRIPTION)
    metrics = IngressMetrics()
    tenant_keys = tenant_keys or {}
    keys_required = api_key is not None or bool(tenant_keys)

    async def check_key(request: Request) -> str | None:  # async: FastAPI runs a sync one on a thread, per request
        """The tenant the request's key authenticates as (None: the key is no tenant's)."""
        if not keys_required:
            return None
        sent = request.headers.get("authorization", "").removeprefix("Bearer ")
        if sent in tenant_keys:
            return tenant_keys[sent]
        if api_key is None or sent != api_key:
            raise OpenAIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                              code="invalid_api_key")  # fmt: skip
        return None

    keyed = [Depends(check_key)]

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, err: OpenAIError) -> JSONResponse:
        metrics.requests.labels(request.url.path, err.status).inc()
        return JSONResponse(err.body(), err.status, headers=err.headers())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        loc = [str(p) for p in first["loc"] if p != "body"]
        param = ".".join(loc) or None
        if first["type"] == "json_invalid":
            message, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
        elif first["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        else:
            message = f"{param or 'body'}: {first['msg']} (given {first.get('input')!r:.200})"
        error = OpenAIError(400, message, param=param)
        if request.url.path in GENERATION_ROUTES:
            ingress.record_invalid(error, GENERATION_ROUTES[request.url.path], time.time())
        return await _openai_error(request, error)

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JSONResponse:
        logger.exception("bug answering %s", request.url.path)
        error = OpenAIError(500, f"internal error: {type(err).__name__}: {err}", "internal_error")
        return await _openai_error(request, error)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, states = await ingress.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", **states}, 200 if ok else 503)

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict:
        model = ingress.model
        card = {"id": model.name, "object": "model", "created": model.created, "owned_by": "slotserve"}
        return {"object": "list", "data": [{**card, "max_model_len": model.max_request_tokens}]}

    @app.get("/metrics", dependencies=keyed)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: str | None = Depends(check_key)):
        return await _generate(body, request, tenant, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, tenant: str | None = Depends(check_key)):
        return await _generate(body, request, tenant, chat=True)

    async def _generate(
        body: CompletionRequest | ChatCompletionRequest, request: Request, tenant: str | None, chat: bool
    ) -> Response:
        arrival = time.time()
        try:
            headers = request.headers
            prepared = ingress.prepare(body, headers.get(SESSION_HEADER), arrival, headers.get(PRIORITY_HEADER), tenant)
        except OpenAIError as err:
            ingress.record_invalid(err, chat, arrival)
            raise
        shape = ResponseShape(chat, prepared.request_id, body.model, body.return_token_ids)
        metrics.in_flight.inc()
        events = ingress.events(prepared)

        async def close() -> None:  # ends the request's events: aborts it on the replica if still running
            metrics.in_flight.dec()
            await events.aclose()

        if not body.stream:  # the whole answer under one watch for the client hanging up
            try:
                return JSONResponse(await unless_disconnected(request, _collect(events, prepared, shape, request)))
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; the request was aborted
            finally:
                await close()
        try:
            # The first event (or the refusal) comes before any byte is sent, so errors keep their status.
            first = await unless_disconnected(request, anext(events))
        except BaseException as err:
            await close()
            if isinstance(err, ClientGone):
                return Response(status_code=499)
            raise
        metrics.ttft.labels(request.url.path).observe(time.time() - arrival)
        return EventStream(_stream(first, events, prepared, shape, body.include_usage), close)

    async def _collect(
        events: AsyncIterator[StreamEvent], prepared: Prepared, shape: ResponseShape, request: Request
    ) -> dict:
        first = await anext(events)
        metrics.ttft.labels(request.url.path).observe(time.time() - prepared.arrival)
        text, token_ids, last = first.text, list(first.token_ids), first
        async for event in events:
            text += event.text
            token_ids += event.token_ids
            last = event
        _check_failed(last)
        _count(shape, prepared, len(token_ids))
        reason = openai_finish_reason(last.finish_reason)
        return shape.response(text, token_ids, reason, usage(len(prepared.prompt_ids), len(token_ids)))

    async def _stream(
        first: StreamEvent,
        events: AsyncIterator[StreamEvent],
        prepared: Prepared,
        shape: ResponseShape,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        made = 0
        try:
            if shape.chat:
                yield shape.role_chunk()
            event = first
            while True:
                made += len(event.token_ids)
                if event.finished and event.finish_reason == "error":
                    yield _error_chunk(event)
                    break
                reason = openai_finish_reason(event.finish_reason) if event.finished else None
                yield shape.chunk(event.text, event.token_ids, reason)
                if event.finished:
                    break
                event = await anext(events)
            if include_usage:
                yield shape.usage_chunk(usage(len(prepared.prompt_ids), made))
            yield SSE_DONE
        finally:
            _count(shape, prepared, made)

    def _count(shape: ResponseShape, prepared: Prepared, made: int) -> None:
        route = "/v1/chat/completions" if shape.chat else "/v1/completions"
        metrics.requests.labels(route, 200).inc()
        metrics.e2e.labels(route).observe(time.time() - prepared.arrival)
        metrics.prompt_tokens.inc(len(prepared.prompt_ids))
        metrics.generation_tokens.inc(made)

    return app


def _check_failed(last: StreamEvent) -> None:
    """A request the cluster accepted and then failed (its step raised, its replica was lost
    for good) is the server's fault."""
    if last.finish_reason == "error":
        raise OpenAIError(500, f"the request failed in the cluster: {last.error}", "internal_error")


def _error_chunk(event: StreamEvent) -> str:
    return sse(OpenAIError(500, f"the request failed in the cluster: {event.error}", "internal_error").body())
