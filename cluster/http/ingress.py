"""From an OpenAI request to the cluster and back: the prompt's token ids (the served model's
tokenizer and chat template), the context check, the sampling parameters, and the stream of
events through the Python client (`cluster.client.Client`, so routing, streaming and abort on
early close are the client's), with every request recorded in the run when it ends.

The ingress tokenizes, so `usage.prompt_tokens` is the real count and the router is given the
real prompt length; it sends the replica token ids, encoded exactly as the replica would have
encoded the text (no special tokens added), so the output equals the Python client's. With a
fake model (no tokenizer) prompts must be token ids."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray

from cluster.client import Client, ClusterError, Result
from cluster.http.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from cluster.http.recorder import RunRecorder
from metrics.definitions import RequestTrace
from protocol import defaults
from protocol.errors import DrainingError, OverloadedError, SlotServeError
from protocol.finish import FinishReason
from protocol.flow import UnknownPriorityError
from protocol.messages import StreamEvent
from replica.errors import InvalidRequestError, RequestTooLongError
from replica.scheduling.request import SamplingParams, validate_prompt

HEALTH_TIMEOUT = 2.0  # seconds the router and each replica get to answer a health check


@dataclass(frozen=True)
class ServedModel:
    """What clients see of the model: its name, its tokenizer (None for a fake model) and the
    most tokens (prompt + output) one request may hold on a replica."""

    name: str
    tokenizer: Any | None
    max_request_tokens: int
    created: int

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None) is not None


@dataclass
class Prepared:
    """A request that passed every check the ingress can make, ready for the cluster."""

    request_id: str
    prompt_ids: list[int]
    params: dict[str, Any]
    session_id: str | None
    arrival: float
    tenant: str = defaults.TENANT

    @property
    def priority(self) -> int:
        return self.params["priority"]

    @property
    def max_tokens(self) -> int:
        return self.params["max_tokens"]


def http_error(err: SlotServeError) -> OpenAIError:
    """The HTTP answer to an error the client or a replica raised on purpose."""
    if isinstance(err, (InvalidRequestError, UnknownPriorityError)):
        code = "context_length_exceeded" if isinstance(err, RequestTooLongError) else None
        return OpenAIError(400, f"{err.field}: {err.reason}", param=err.field, code=code)
    if isinstance(err, DrainingError):
        return OpenAIError(503, str(err), "service_unavailable", code="draining", retry_after=err.retry_after or 1)
    if isinstance(err, OverloadedError):
        return OpenAIError(429, str(err), "rate_limit_exceeded", code="overloaded", retry_after=err.retry_after)
    if isinstance(err, ValueError):
        return OpenAIError(400, str(err))
    return OpenAIError(503, str(err), "service_unavailable", code="cluster_unavailable", retry_after=1)


def ending(err: OpenAIError) -> FinishReason:
    """How a refused request is recorded: `invalid` when the request was at fault (4xx),
    `rejected` when the cluster was overloaded (429), `error` when it could not serve (5xx)."""
    if err.status == 429:
        return FinishReason.REJECTED
    return FinishReason.INVALID if err.status < 500 else FinishReason.ERROR


def request_id(chat: bool) -> str:
    """A new request id in OpenAI's style (`chatcmpl-...`, `cmpl-...`)."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


class Ingress:
    def __init__(self, client: Client, model: ServedModel, recorder: RunRecorder | None = None):
        self.client, self.model, self.recorder = client, model, recorder

    # ---- before the cluster ---------------------------------------------------------------
    def prepare(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        session_header: str | None,
        arrival: float,
        priority_header: str | None = None,
        key_tenant: str | None = None,
    ) -> Prepared:
        """Every check that needs no replica; raises OpenAIError (400 naming the field, 404 for
        another model). The priority is the body's, else the X-Priority header's; the tenant is
        the one the API key authenticates as (`key_tenant`), else the `user` (else the default
        tenant)."""
        body.check_supported()
        priority = body.priority
        if priority is None and priority_header is not None:
            try:
                priority = int(priority_header)
            except ValueError:
                raise OpenAIError(
                    400, f"priority: X-Priority must be an integer, got {priority_header!r:.40}", param="priority"
                ) from None
        if body.model != self.model.name:
            raise OpenAIError(
                404, f"The model `{body.model}` does not exist; this server serves `{self.model.name}`.",
                param="model", code="model_not_found",
            )  # fmt: skip
        chat = isinstance(body, ChatCompletionRequest)
        prompt_ids = self._chat_ids(body) if chat else self._prompt_ids(body.single_prompt())
        limit = self.model.max_request_tokens
        max_tokens = body.max_new_tokens()
        if max_tokens is None:  # chat's default, as vLLM's: the rest of the context
            max_tokens = max(1, limit - len(prompt_ids))
        if len(prompt_ids) + max_tokens > limit:
            where = "messages" if chat else "prompt"
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the {where}, {max_tokens} in the "
                f"completion). Please reduce the length of the {where} or completion.",
                param=where if len(prompt_ids) >= limit else "max_tokens",
                code="context_length_exceeded",
            )
        params = body.sampling(max_tokens, defaults.PRIORITY if priority is None else priority)
        try:
            SamplingParams.parse(params)
        except InvalidRequestError as err:
            raise http_error(err) from None
        session = body.user or session_header
        tenant = key_tenant or body.user or defaults.TENANT
        return Prepared(request_id(chat), prompt_ids, params, session, arrival, tenant)

    def record_invalid(self, err: OpenAIError, chat: bool, arrival: float) -> None:
        """Record a request refused before it reached the cluster (a 400 or 404) in the run,
        with its status, so bad input shows in `slotserve report` apart from overload."""
        if self.recorder is not None:
            trace = RequestTrace(
                request_id(chat), arrival, [], time.time(), FinishReason.INVALID, 0, error=f"HTTP {err.status}: {err}"
            )
            self.recorder.record(trace)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        try:
            validate_prompt(prompt)
        except InvalidRequestError as err:
            raise http_error(err) from None
        if isinstance(prompt, list):
            if not prompt:
                raise OpenAIError(400, "prompt: is empty", param="prompt")
            return prompt
        if self.model.tokenizer is None:
            raise OpenAIError(400, "prompt: this model has no tokenizer: give token ids", param="prompt")
        ids = self.model.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        if not ids:
            raise OpenAIError(400, "prompt: is empty", param="prompt")
        return ids

    def _chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        if not self.model.has_chat_template:
            raise OpenAIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
        messages = [m.as_template_input() for m in body.messages]
        for i, m in enumerate(messages):
            try:
                validate_prompt(m["content"])
            except InvalidRequestError as err:
                raise OpenAIError(400, f"messages.{i}.content: {err.reason}", param=f"messages.{i}.content") from None
        text = self.model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.model.tokenizer.encode(text, add_special_tokens=False)

    # ---- through the cluster ------------------------------------------------------------------
    async def events(self, prepared: Prepared) -> AsyncIterator[StreamEvent]:
        """The request's events from its replica; however it ends (finished, refused, or the
        consumer leaving, which aborts it on the replica) its trace is recorded once."""
        result = Result(prepared.request_id, None, prepared.arrival)
        stream = self.client.astream(
            prepared.prompt_ids, prepared.session_id, prepared.request_id, tenant=prepared.tenant, **prepared.params
        )
        try:
            async for event in stream:
                result.replica_id = event.replica_id
                result.add(event)
                yield event
        except SlotServeError as err:
            answer = http_error(err)
            result.finish_reason, result.error = ending(answer), f"HTTP {answer.status}: {answer}"
            raise answer from None
        finally:
            await stream.aclose()  # a stream left early is aborted on its replica now, not when collected
            if result.finish_reason is None:  # the HTTP client went away: the client aborted it
                result.finish_reason = "abort"
            if result.completion is None:
                result.completion = time.time()
            if self.recorder is not None:
                self.recorder.record(
                    result.trace(
                        len(prepared.prompt_ids),
                        prepared.max_tokens,
                        prepared.session_id,
                        prepared.arrival,
                        priority=prepared.priority,
                        tenant=prepared.tenant,
                    )
                )

    async def health(self) -> tuple[bool, dict[str, str]]:
        """Whether the router answers and at least one replica is healthy, and each one's state."""
        try:
            replicas = await asyncio.wait_for(self.client.router.replicas.remote(), HEALTH_TIMEOUT)
        except (TimeoutError, ray.exceptions.RayError, ClusterError) as err:
            return False, {"router": f"unreachable: {err}"}
        states = {"router": "ok"}
        reports = await asyncio.gather(
            *[asyncio.wait_for(h.health.remote(), HEALTH_TIMEOUT) for h in replicas.values()], return_exceptions=True
        )
        for replica_id, report in zip(replicas, reports):
            if isinstance(report, BaseException):
                states[replica_id] = f"unreachable: {type(report).__name__}"
            elif not report.healthy or report.draining:
                states[replica_id] = report.reason or "draining"
            else:
                states[replica_id] = "ok"
        return any(state == "ok" for name, state in states.items() if name != "router"), states
