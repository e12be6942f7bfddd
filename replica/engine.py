# Over 400 lines: the engine's whole surface (submission, the step, hand-overs between replicas,
# offline generate) is one object's, and each piece is short.
"""One engine replica: a batching scheduler, a model runner, and the loop that joins them.

`add_request` validates and queues, `step()` runs one scheduled forward pass and reports what
happened (new tokens, finished requests, a per-step record), `abort` cancels, and
`generate()` is the blocking offline call. Every request ends with exactly one final
`RequestOutput` (finished=True) carrying its reason. `add_request(hand_over=True)`,
`hand_over` and `import_request` move a request with its K/V between engines (prefill/decode
disaggregation, `replica.scheduling.handover`). No Ray here: the actor wraps this.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from protocol.clock import Clock, WallClock
from protocol.cost import StepPricing
from protocol.handover import Handover
from protocol.messages import KvEvents, LoadReport
from protocol.records import StepRecord
from protocol.replicas import Resume
from replica.config import EngineConfig
from replica.errors import ConfigError, InvalidRequestError, InvariantViolation, RequestTooLongError
from replica.pricing import LoopGap, MeasuredPricing
from replica.scheduling.handover import KvTransfer, can_export
from replica.scheduling.policies import make_scheduler
from replica.scheduling.request import FinishReason, Request, SamplingParams
from replica.scheduling.scheduler import SchedulerOutput


class Runner(Protocol):
    """What the engine needs from a model: the real ModelRunner or a fake one."""

    tokenizer: Any  # None for fakes: prompts must then be token ids
    vocab_size: int
    max_model_len: int
    eos_token_ids: set[int]

    def execute(self, out: SchedulerOutput) -> list[int]: ...

    def release(self, request_id: str) -> None: ...


@dataclass
class RequestOutput:
    """What one step did to one request: new tokens, and whether it ended (and why)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    time: float
    error: str | None = None
    # Set on the final output: the tokens the request made in all (a router's length estimates learn from it),
    # and the prompt tokens the prefix cache held at its first admission (None: never admitted), which
    # measure how stale a prefix-aware router's belief was.
    num_output_tokens: int | None = None
    num_cached_prompt_tokens: int | None = None
    # Set on the final output of a request handed over (finish reason MIGRATE): what goes to the receiver.
    handover: Handover | None = None


@dataclass
class StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    record: StepRecord | None = None  # None when nothing could run


@dataclass
class Completion:
    """A finished request, as `generate()` returns it."""

    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    arrival_time: float
    token_times: list[float]
    num_preemptions: int
    error: str | None = None


class Engine:
    def __init__(self, config: EngineConfig | None = None, runner: Runner | None = None, clock: Clock | None = None):
        self.config = config or EngineConfig()
        self.clock = clock or WallClock()
        if runner is None:
            from replica.model.runner import ModelRunner  # torch only when a real model is asked for

            runner = ModelRunner(self.config)
        if self.config.max_seq_len > runner.max_model_len:  # a slot can't hold more than the model's context
            self.config = self.config.model_copy(update={"max_seq_len": runner.max_model_len})
        cache = getattr(runner, "cache", None)  # a shared runner's cache must hold this engine's slots or blocks
        if cache is not None and (problem := cache.mismatch(self.config)) is not None:
            raise ConfigError(problem)
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self._decode = None if self.tokenizer is None else text_decoder(self.tokenizer)
        self.scheduler = make_scheduler(self.config.policy, self.config, self.clock)
        # How its steps are priced, on its load reports for a router that predicts latency: a
        # fake runner states its cost model (`step_cost`); a real model's is fitted to its steps.
        cost = getattr(runner, "step_cost", None)
        budget = self.config.token_budget if self.scheduler.reads_token_budget else None
        self.stated_pricing = None if cost is None else StepPricing(cost, budget)
        self.measured_pricing = MeasuredPricing(budget) if cost is None else None
        self.loop_gap = LoopGap() if cost is not None else None  # what the stated prices leave out
        self.requests: dict[str, Request] = {}  # unfinished ones
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._held: dict[str, int] = {}  # chars at the end of a request's text not streamed yet
        # Per request, the incremental detokenizer's (prefix, read) offsets into its output tokens
        # (`_detokenize_delta`); a request without one is decoded in full once.
        self._windows: dict[str, tuple[int, int]] = {}
        block_size = self.config.block_size if self.config.kv_cache == "paged" else 0
        self.kv_transfer = KvTransfer(cache, block_size, getattr(runner, "kv_bytes_per_token", 0))

    # ---- submission --------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | dict | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        oracle_output_len: int | None = None,
        resume: Resume | None = None,
        hand_over: bool = False,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError (naming the field) and
        queues nothing when any part of it is wrong. `resume`: the tokens another replica
        already made for it, which become output the scheduler prefills with the prompt.
        `hand_over`: this replica only prefills it (the prefill role): once its first token
        is sampled it ends here with finish reason MIGRATE and a `Handover` for a decode
        replica on its final output (unless that token already ended it)."""
        sampling = SamplingParams.parse(params)
        prompt_ids = self._tokenize(prompt)
        if sampling.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a model with a tokenizer")
        limit = self.scheduler.slots.max_request_tokens
        if len(prompt_ids) + sampling.max_tokens > limit:
            field_name = "prompt" if len(prompt_ids) >= limit else "max_tokens"
            raise RequestTooLongError(
                field_name,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) = "
                f"{len(prompt_ids) + sampling.max_tokens} exceeds this replica's limit of {limit} tokens "
                f"(max_seq_len {self.scheduler.slots.max_seq_len}, K/V budget {self.scheduler.slots.kv_budget_tokens})",
            )
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", f"must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        request = Request(
            request_id,
            prompt_ids,
            sampling,
            self.clock.now() if arrival_time is None else arrival_time,
            oracle_output_len,
        )
        if resume is not None:
            request.resume_from(resume.token_ids, resume.text)
        request.hand_over = hand_over
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _tokenize(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer: give token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise InvalidRequestError(
                    "prompt", f"token ids must be in [0, {self.runner.vocab_size}), got {bad[:5]}"
                )
        else:
            raise InvalidRequestError("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("prompt", "is empty")
        return ids

    def import_request(self, handover: Handover) -> bool:
        """Admit a request another replica handed over (the decode role): it is validated like
        any submission and queued with its K/V, written into its rows when it is admitted, so
        it decodes on without computing its prompt. Returns False when its K/V cannot be used
        here (no tensors, another model's shape): it then recomputes them, as a resumed request."""
        request_id = self.add_request(
            handover.prompt_token_ids,
            handover.sampling,
            handover.request_id,
            handover.arrival_time,
            resume=Resume(handover.output_token_ids, handover.text),
        )
        return self.kv_transfer.take(self.requests[request_id], handover)

    def hand_over(self, request_id: str) -> RequestOutput:
        """End a decoding request here and return its final output with its `Handover` (a
        drain that moves K/V instead of recomputing them); InvalidRequestError if it is not
        decoding (waiting, or mid-prefill: it has no K/V to continue from)."""
        request = self.requests.get(request_id)
        if request is None or not can_export(request):
            raise InvalidRequestError("request_id", f"{request_id!r} is not decoding here")
        return self._export(request, [], "")

    def _export(self, request: Request, new_tokens: list[int], new_text: str) -> RequestOutput:
        delivered = request.text[: len(request.text) - self._held.get(request.request_id, 0)]
        handover = self.kv_transfer.export(request, delivered, self.clock.now())
        output = self._finish(request, FinishReason.MIGRATE, new_tokens, new_text)
        output.handover = handover
        return output

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; returns its final event, or None if it is not running here."""
        request = self.requests.get(request_id)
        return None if request is None else self._finish(request, FinishReason.ABORT, [], "")

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt prefixes no request holds (paged cache with prefix caching),
        so a measured run does not inherit the hits of the one before; returns blocks forgotten."""
        return self.scheduler.slots.reset_prefix_cache()

    def take_kv_events(self) -> KvEvents | None:
        """The prefix cache's changes since the last call (`replica.scheduling.kv_events`)."""
        return self.scheduler.slots.take_kv_events()

    def request_kv_snapshot(self) -> bool:
        """Make the next `take_kv_events` a snapshot of the whole prefix cache; whether this
        engine's cache reports K/V events at all."""
        return self.scheduler.slots.request_kv_snapshot()

    def set_arrivals_done(self, done: bool) -> None:
        """Whether more requests may come before one of the running ones ends; with none
        coming, a static batch need not wait to be full."""
        self.scheduler.set_arrivals_done(done)

    # ---- the loop ----------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def wake_time(self) -> float | None:
        """When the batching policy may admit by itself, with nothing else happening (None:
        not by time)."""
        return self.scheduler.wake_time()

    def load_report(self, replica_id: str, queued: int = 0) -> LoadReport:
        """The load at a step boundary, as a router reads it; `queued` counts submissions not
        yet in the engine's queue (a serving loop's inbox)."""
        slots = self.scheduler.slots
        live = self.scheduler.live_requests()
        return LoadReport(
            replica_id,
            self.num_waiting + queued,
            self.num_running,
            slots.num_free_slots,
            slots.num_slots,
            slots.free_kv_tokens,
            self.clock.now(),
            prefill_tokens_pending=sum([max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in live]),
            decode_tokens_made=sum([r.num_output_tokens for r in live]),
            tokens_made={r.request_id: r.num_output_tokens for r in live},
            ttft={r.request_id: r.token_times[0] - r.arrival_time for r in live if r.token_times},
            pricing=self.pricing,
            kv_capacity_tokens=slots.kv_budget_tokens,
        )

    @property
    def pricing(self) -> StepPricing | None:
        """Its step prices as its load reports state them (None: a real model not yet measured)."""
        if self.measured_pricing is not None:
            return self.measured_pricing.pricing
        # a fake runner: the prices it states, with the loop time measured between its steps
        return replace(self.stated_pricing, loop_overhead=self.loop_gap.seconds)

    def step(self) -> StepResult:
        out = self.scheduler.schedule()
        if self.kv_transfer.pending:
            self.kv_transfer.write_admitted(self.scheduler.slots)
        if out.is_empty:
            return StepResult()
        start = self.clock.now()
        live_slots = self.scheduler.slots.num_used_slots
        try:
            tokens = self.runner.execute(out)
        except Exception as err:  # noqa: BLE001 - the step's requests fail, the replica keeps serving
            message = f"{type(err).__name__}: {err}"
            outputs = [self._finish(c.request, FinishReason.ERROR, [], "", message) for c in out.chunks]
            return StepResult(outputs, self._record(out, start, live_slots))
        self.scheduler.advance(out)
        now = self.clock.now()
        sampling = [c.request for c in out.chunks if c.samples]
        outputs = [self._append(request, token, now) for request, token in zip(sampling, tokens)]
        record = self._record(out, start, live_slots)
        if self.measured_pricing is not None:  # steps that ran only: a failed one's time says nothing
            self.measured_pricing.observe(record, goes_on=self.has_unfinished)
        if self.loop_gap is not None:
            self.loop_gap.observe(record, goes_on=self.has_unfinished)
        return StepResult(outputs, record)

    def _record(self, out: SchedulerOutput, start: float, live_slots: int) -> StepRecord:
        return StepRecord(
            step=next(self._steps),
            start=start,
            duration=self.clock.now() - start,
            num_decode_tokens=out.num_decode_tokens,
            num_prefill_tokens=out.num_prefill_tokens,
            context_tokens=out.context_tokens,
            live_slots=live_slots,
            useful_rows=len(out.chunks),
            computed_rows=len(out.chunks) + len(out.held_rows),
            num_preemptions=len(out.preempted),
            queue_depth=len(self.scheduler.waiting),
        )

    def _append(self, request: Request, token: int, now: float) -> RequestOutput:
        request.output_token_ids.append(token)
        request.token_times.append(now)
        p = request.params
        sent = len(request.text) - self._held.pop(request.request_id, 0)
        new_text = self._detokenize_delta(request)
        made = request.num_output_tokens
        reason = None
        if made < p.min_tokens:
            pass  # min_tokens (as vLLM): no EOS, stop token or stop string ends it this early
        elif token in p.stop_token_ids:
            reason = FinishReason.STOP
        elif token in self.runner.eos_token_ids and not p.ignore_eos:
            reason = FinishReason.EOS
        elif p.stop and (hit := _first_stop(request.text, p.stop, len(request.text) - len(new_text))) is not None:
            new_text = new_text[: max(0, hit - (len(request.text) - len(new_text)))]
            request.text = request.text[:hit]
            reason = FinishReason.STOP
        elif made >= p.max_tokens:
            reason = FinishReason.LENGTH
        if p.stop:  # stream nothing that may yet turn out to start a stop string
            upto = len(request.text) - (0 if reason is not None else _stop_prefix_len(request.text, p.stop))
            self._held[request.request_id] = len(request.text) - upto
            new_text = request.text[sent:upto]
        if reason is not None:
            return self._finish(request, reason, [token], new_text)
        if request.hand_over:
            return self._export(request, [token], new_text)
        return RequestOutput(request.request_id, [token], new_text, False, None, now)

    def _detokenize_delta(self, request: Request) -> str:
        """The text the newest token adds, appended to `request.text`. As vLLM's incremental
        detokenizer: only the tokens from the prefix offset on are decoded, and the text of those
        before the read offset (already emitted) is cut off the front, so a step costs the same
        at any output length (decoding the whole output each step is quadratic in its length).
        The prefix tokens give the decoder its context: a leading space a tokenizer strips at the
        start of what it decodes, a character whose bytes span tokens. Nothing is emitted while
        the decode ends in a partial UTF-8 character (U+FFFD); the window grows until the next
        token completes it. A request's first token here (fresh, or resumed with the text another
        replica delivered) is decoded against `request.text` from the first output token."""
        if self.tokenizer is None:
            return ""
        ids = request.output_token_ids
        prefix, read = self._windows.get(request.request_id, (0, 0))
        text = self._decode(ids[prefix:])
        before = self._decode(ids[prefix:read]) if read else request.text
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        delta = text[len(before) :]
        request.text += delta
        self._windows[request.request_id] = (read, len(ids))
        return delta

    def _finish(
        self, request: Request, reason: FinishReason, new_tokens: list[int], new_text: str, error: str | None = None
    ) -> RequestOutput:
        self.scheduler.finish(request, reason)
        request.error = error
        self.runner.release(request.request_id)
        self._held.pop(request.request_id, None)
        self._windows.pop(request.request_id, None)
        self.kv_transfer.pending.pop(request.request_id, None)
        del self.requests[request.request_id]
        return RequestOutput(
            request.request_id,
            new_tokens,
            new_text,
            True,
            reason,
            self.clock.now(),
            error,
            request.num_output_tokens,
            num_cached_prompt_tokens=request.num_cached_prompt_tokens,
        )

    def wait_idle(self, next_arrival: float | None = None) -> None:
        """Nothing could run this step: sleep until the policy's timer or the next arrival."""
        wakes = [t for t in (self.wake_time(), next_arrival) if t is not None]
        if not wakes:
            raise InvariantViolation(f"{self.scheduler.name}: requests wait but nothing can ever run them")
        self.clock.sleep(max(0.0, min(wakes) - self.clock.now()))

    # ---- offline use ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams | dict | Sequence | None = None,
        oracle_output_lens: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Run `prompts` to completion and return them in order. All arrive now and no more
        will come, so a static batch need not wait to fill."""
        per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise InvalidRequestError("params", f"{len(per_prompt)} params for {len(prompts)} prompts")
        lens = oracle_output_lens or [None] * len(prompts)
        requests: list[Request] = []
        try:
            for prompt, p, n in zip(prompts, per_prompt, lens):
                requests.append(self.requests[self.add_request(prompt, p, oracle_output_len=n)])
        except InvalidRequestError:
            for request in requests:  # all or nothing: leave no orphan queued
                self.abort(request.request_id)
            raise
        was_done = self.scheduler.arrivals_done
        self.set_arrivals_done(True)
        try:
            while any(not r.is_finished for r in requests):
                if self.step().record is None:
                    self.wait_idle()
        finally:
            self.set_arrivals_done(was_done)
        return [completion(r, prompt) for r, prompt in zip(requests, prompts)]


def completion(request: Request, prompt: str | list[int]) -> Completion:
    return Completion(
        request.request_id,
        prompt,
        request.prompt_token_ids,
        list(request.output_token_ids),
        request.text,
        request.finish_reason,
        request.arrival_time,
        list(request.token_times),
        request.num_preemptions,
        request.error,
    )


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """The text of token ids, special tokens skipped, as `tokenizer.decode` gives it. A fast
    tokenizer that cleans up no spaces afterwards returns its Rust backend's decode unchanged,
    so that is called straight: the Python wrapper around it (argument conversion, its checks)
    costs more than the decode of the few tokens a step's window holds, for every row of every
    step."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def _first_stop(text: str, stops: list[str], new_from: int) -> int | None:
    """Index where the earliest stop string starts, looking only where new text could complete one."""
    hits = [i for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is the start of a stop string (held back from
    the stream until the next tokens show whether the stop string completes)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)
