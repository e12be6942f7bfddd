"""What a request is: its validated sampling parameters and the plain object the scheduler
moves between queues. Like nano-vllm's Sequence, a request's state is read off explicit
counters (`num_computed_tokens`, `output_token_ids`), never rebuilt from history."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protocol import defaults
from protocol.finish import FinishReason
from protocol.handover import Handover
from replica.errors import InvalidRequestError

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed; past it a whole step fails
MAX_PROMPT_LEN = 1_000_000  # characters or token ids; far past any context, so only garbage is refused
MAX_REQUEST_ID_LEN = 256


def validate_prompt(prompt: Any) -> None:
    """Refuse a prompt no model could take before it reaches a tokenizer: not a string or a
    list of non-negative token ids, longer than MAX_PROMPT_LEN, or not encodable as UTF-8 (a
    lone surrogate, which is what undecodable bytes on a command line become). The replica
    still checks token ids against its vocabulary and the length against its limits."""
    if isinstance(prompt, str):
        if len(prompt) > MAX_PROMPT_LEN:
            raise InvalidRequestError("prompt", f"{len(prompt)} characters exceeds the limit of {MAX_PROMPT_LEN}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise InvalidRequestError(
                "prompt",
                f"is not valid UTF-8 text: {prompt[err.start]!r} at index {err.start} "
                "(a lone surrogate, e.g. from undecodable bytes)",
            ) from None
        return
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
    if len(prompt) > MAX_PROMPT_LEN:
        raise InvalidRequestError("prompt", f"{len(prompt)} token ids exceeds the limit of {MAX_PROMPT_LEN}")
    bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or t < 0]
    if bad:
        raise InvalidRequestError("prompt", f"token ids must be non-negative integers, got {bad[:5]!r}")


def validate_request_id(request_id: Any) -> str:
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        given = repr(request_id)[:80]
        raise InvalidRequestError(
            "request_id", f"must be a non-empty string of at most {MAX_REQUEST_ID_LEN} characters, got {given}"
        )
    return request_id


class SamplingParams(BaseModel):
    """Per-request generation parameters; every request in one batch may differ."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    max_tokens: int = Field(16, gt=0, description="most tokens to generate")
    temperature: float = Field(0.0, ge=0.0, description="0 means greedy")
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="per-request RNG seed for sampling")
    stop: list[str] = Field(default_factory=list, description="stop strings")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="tokens to make before EOS or a stop may end the request")
    # Not a sampling choice, but it travels with them to the replica on every path (client,
    # simulator, hand-over), as vLLM's `priority` goes with a request to its scheduler.
    priority: int = Field(defaults.PRIORITY, description="lower is admitted first, and may preempt a higher one")

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, value: int, info) -> int:
        if "max_tokens" in info.data and value > info.data["max_tokens"]:
            raise ValueError(f"must be at most max_tokens ({info.data['max_tokens']}), got {value}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            for item in value:
                if not isinstance(item, str):
                    raise ValueError(f"stop entries must be strings, got {type(item).__name__} {item!r}")
                if item == "":
                    raise ValueError("stop strings must not be empty")
            return list(value)
        raise ValueError(f"must be a string or a list of strings, got {type(value).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def parse(cls, params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """Validate user input, turning pydantic's report into an error naming the field."""
        if params is None:
            return cls()
        if isinstance(params, cls):
            return params
        if not isinstance(params, dict):
            raise InvalidRequestError("params", f"expected a dict or SamplingParams, got {type(params).__name__}")
        if not all(isinstance(k, str) for k in params):
            raise InvalidRequestError("params", f"parameter names must be strings, got {list(params)!r}")
        try:
            return cls.model_validate(params)
        except ValidationError as err:
            first = err.errors()[0]
            name = ".".join(str(p) for p in first["loc"]) or "params"
            if first["type"] == "extra_forbidden":
                raise InvalidRequestError(name, f"unknown parameter; known: {', '.join(cls.model_fields)}") from None
            raise InvalidRequestError(name, f"{first['msg']} (given {first.get('input')!r})") from None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # True output length when the caller knows it (forced-length workloads); only the
    # `bucketed` oracle policy reads it.
    oracle_output_len: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens (prompt + output) whose K/V are in this request's slot.
    num_computed_tokens: int = 0
    slot: int | None = None
    # Paged cache only: the blocks holding this request's K/V, in position order, and the
    # chained hashes of its full blocks (kept across preemption: tokens are append-only).
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Set by the engine: when each output token was made, and the detokenized text so far.
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    # Disaggregation (`replica.scheduling.handover`): hand the request over once its first token
    # is sampled (a prefill replica's request), and the K/V it came with from another replica,
    # written into its rows when it is admitted here (then None: a later preemption recomputes).
    hand_over: bool = False
    kv_in: Handover | None = None
    # Prompt tokens the prefix cache held at the request's first admission (None before it): set
    # once, so a router can measure what it believed cached against what was.
    num_cached_prompt_tokens: int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_kv_in(self) -> int:
        """Leading tokens whose K/V came with the request and wait to be written here."""
        return 0 if self.kv_in is None else self.kv_in.num_kv_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is pending: the request needs one row this step."""
        return self.num_output_tokens > 0 and self.num_pending_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def resume_from(self, token_ids: list[int], text: str) -> None:
        """Continue a request another replica started: `token_ids` were already generated
        (and delivered as `text`), so they become output the scheduler prefills with the
        prompt, as after a preemption; the next token sampled is the one after them, and
        max_tokens counts them."""
        if self.num_computed_tokens or self.output_token_ids:
            raise InvalidRequestError("resume", f"request {self.request_id!r} has already started here")
        self.output_token_ids = list(token_ids)
        self.token_times = [self.arrival_time] * len(token_ids)
        self.text = text

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output."""
        n = self.num_prompt_tokens
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]
