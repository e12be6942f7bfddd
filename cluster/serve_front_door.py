"""Ray Serve's own front door over the same fake replicas, the peer of slotserve's ingress in
the front-door benchmark: Serve's HTTP proxy routing each request by Serve's default router
(power of two choices) straight to a replica deployment that answers OpenAI completions, the
shape of a Serve app whose proxy calls the model replicas directly.

Each replica runs the replica engine's serving loop (`replica.serving.loop.AsyncEngine`), as
`cluster.serve_baseline` deploys it, and reads the body with slotserve's own OpenAI request
model (`cluster.http.openai_protocol`), so the two front doors parse, validate and answer
alike; what differs is the path between the socket and the engine."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from cluster.http.openai_protocol import SSE_DONE, CompletionRequest, ResponseShape, openai_finish_reason, usage
from replica.serving.loop import AsyncEngine, ReplicaConfig, build_engine

APP_NAME = "slotserve-serve-front-door"


class HttpEngineDeployment:
    """One Serve replica answering `/v1/completions` (streamed or not) from its engine."""

    def __init__(self, config: dict):
        self.serving = AsyncEngine(build_engine(ReplicaConfig.model_validate(config)), lambda _: None)

    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        body = CompletionRequest.model_validate_json(await request.body())
        prompt = body.single_prompt()
        max_tokens = body.max_new_tokens() or 16
        shape = ResponseShape(False, f"cmpl-{uuid.uuid4().hex}", body.model, body.return_token_ids)
        outputs = self.serving.generate(prompt, body.sampling(max_tokens), shape.id, time.time())
        if body.stream:
            return StreamingResponse(_chunks(outputs, shape), media_type="text/event-stream")
        text, token_ids, reason = "", [], None
        async for out in outputs:
            text += out.new_text
            token_ids += out.new_token_ids
            reason = out.finish_reason
        return JSONResponse(
            shape.response(text, token_ids, openai_finish_reason(reason), usage(len(prompt), len(token_ids)))
        )


async def _chunks(outputs: AsyncIterator, shape: ResponseShape) -> AsyncIterator[str]:
    async for out in outputs:
        reason = openai_finish_reason(out.finish_reason) if out.finished else None
        yield shape.chunk(out.new_text, out.new_token_ids, reason)
    yield SSE_DONE


def start_serve_front_door(config: ReplicaConfig, num_replicas: int, port: int, num_cpus: float) -> None:
    """Serve's proxy on `port` (this node) in front of `num_replicas` engine replicas."""
    from ray import serve

    app = (
        serve.deployment(HttpEngineDeployment)
        .options(
            name="engine",
            num_replicas=num_replicas,
            max_ongoing_requests=config.max_queue,
            ray_actor_options={"num_cpus": num_cpus},
        )
        .bind(config.model_dump())
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(app, name=APP_NAME, route_prefix="/v1/completions")


def stop_serve_front_door() -> None:
    from ray import serve

    serve.shutdown()
