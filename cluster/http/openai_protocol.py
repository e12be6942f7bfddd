"""The OpenAI HTTP API's shapes: request bodies (pydantic, validated at the door), the error
body, and the response and stream-chunk bodies, as OpenAI and vLLM write them.

Requests accept OpenAI's fields and vLLM's extensions that slotserve implements (`top_k`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `return_token_ids`, `priority`). A field OpenAI defines but
slotserve does not implement (`logprobs`, `echo`, penalties, `logit_bias`, tools...) is a 400
naming it when it asks for something, never silently ignored; an unknown field is a 400 too,
as OpenAI answers. Response bodies are plain dicts: a stream chunk is built once per engine
step per request, so it costs one dict and one `json.dumps`, no model validation."""

from __future__ import annotations

import json
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.errors import SlotServeError


class OpenAIError(SlotServeError):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`
    with an HTTP status (and a Retry-After header when `retry_after` is given)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


def unsupported(param: str, detail: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {detail} is not supported by slotserve", param=param, code="unsupported")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(
        None,
        description="sampling temperature; left out: 1.0, OpenAI's default (the slotserve CLI and Python "
        "client default to 0, greedy); 0 is greedy",
    )
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM extension; 0 or -1 disables")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(
        None, description="the session id, for session-affinity routing, and the tenant flow control shares among"
    )
    priority: int | None = Field(
        None,
        description="vLLM extension: the request's band in the router's flow control, lower served first; "
        "left out: the X-Priority header's, else 0",
    )
    ignore_eos: bool = False
    min_tokens: int = 0
    return_token_ids: bool = Field(False, description="vLLM extension: each choice carries its token ids")
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def check_supported(self) -> None:
        """400 for a request that asks for what slotserve does not do."""
        if self.n != 1:
            raise unsupported("n", f"n={self.n} (one choice per request)")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise unsupported(name, f"a non-zero {name}")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias")

    def sampling(self, max_tokens: int, priority: int) -> dict[str, Any]:
        """The request as `replica.scheduling.request.SamplingParams` fields (validated there, so a bad
        value is a 400 naming the same field)."""
        return {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k in (None, -1) else self.top_k,
            "seed": self.seed,
            "stop": [] if self.stop is None else self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "priority": priority,
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise unsupported("logprobs", "logprobs")
        if self.echo:
            raise unsupported("echo", "echo")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"best_of={self.best_of}")
        if self.suffix:
            raise unsupported("suffix", "suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text, token ids, or a batch of exactly one of either."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise unsupported("prompt", f"a batch of {len(prompt)} prompts (one per request)")
            prompt = prompt[0]
        return prompt

    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise unsupported("logprobs", "logprobs")
        if self.tools:
            raise unsupported("tools", "tool calling")
        if self.tool_choice not in (None, "none", "auto"):
            raise unsupported("tool_choice", "tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            raise unsupported("response_format", f"response_format {self.response_format.get('type')!r}")

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- response bodies ---------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def openai_finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, reason)


class ResponseShape:
    """Builds one request's response and stream chunks (completions or chat): the id, the
    object names and the choice layout differ, nothing else."""

    def __init__(self, chat: bool, request_id: str, model: str, return_token_ids: bool):
        self.chat, self.id, self.model, self.token_ids = chat, request_id, model, return_token_ids
        self.created = int(time.time())

    def _choice(self, text: str, token_ids: list[int], finish_reason: str | None, delta: bool) -> dict:
        if not self.chat:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        elif delta:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None}
            choice["finish_reason"] = finish_reason
        else:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        if self.token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _envelope(self, chunk: bool, choices: list[dict], usage_: dict | None) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage_ is not None or not chunk:
            body["usage"] = usage_
        return body

    def response(self, text: str, token_ids: list[int], finish_reason: str | None, usage_: dict) -> dict:
        """The whole answer of a request that did not stream."""
        return self._envelope(False, [self._choice(text, token_ids, finish_reason, False)], usage_)

    def role_chunk(self) -> str:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return sse(self._envelope(True, [choice], None))

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None, usage_: dict | None = None) -> str:
        """One engine step's tokens of this request as one server-sent event."""
        return sse(self._envelope(True, [self._choice(text, token_ids, finish_reason, True)], usage_))

    def usage_chunk(self, usage_: dict) -> str:
        """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
        return sse(self._envelope(True, [], usage_))


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
