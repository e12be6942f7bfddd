# Over 400 lines: one table of bad inputs per entry point; splitting it would scatter the table.
"""Bad input never kills the engine: each is refused with an InvalidRequestError naming the
field, leaves nothing queued, and valid requests around it are served as usual. A step whose
runner raises fails only that step's requests. Also the Sampler, on small logits tensors."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from protocol.clock import FakeClock
from replica.config import EngineConfig
from replica.engine import Engine
from replica.errors import InvalidRequestError, RequestTooLongError
from replica.kernels import fused_ops
from replica.model.fake import ScriptedFakeRunner
from replica.model.sampler import Sampler
from replica.scheduling.policies import POLICIES
from replica.scheduling.request import FinishReason, Request, SamplingParams

VOCAB = 50
MAX_SEQ_LEN = 64


class ToyTokenizer:
    """One character per token id, so string prompts can be tested without a real model."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class TokenizedRunner(ScriptedFakeRunner):
    tokenizer = ToyTokenizer()


class FailingRunner(ScriptedFakeRunner):
    """Raises on its `fail_at`-th call of execute() (0-based), once; otherwise the scripted model."""

    def __init__(self, clock, fail_at: int, **kw):
        super().__init__(clock, **kw)
        self.fail_at = fail_at
        self.calls = 0
        self.failed_request_ids: list[str] = []

    def execute(self, out):
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_at:
            self.failed_request_ids = [c.request.request_id for c in out.chunks]
            raise RuntimeError("injected device failure")
        return super().execute(out)


def make_engine(policy: str = "mixed", runner_cls=ScriptedFakeRunner, num_slots: int = 4, **runner_kw):
    clock = FakeClock()
    runner = runner_cls(clock, vocab_size=VOCAB, **runner_kw)
    config = EngineConfig(policy=policy, num_slots=num_slots, max_seq_len=MAX_SEQ_LEN, kv_budget_tokens=None)
    return Engine(config, runner=runner, clock=clock), runner


def queued_ids(engine: Engine) -> set[str]:
    s = engine.scheduler
    return {r.request_id for r in (*s.waiting, *s.running, *s.held)}


def run_all(engine: Engine, max_steps: int = 500) -> dict:
    """Step until done; returns request_id -> final RequestOutput, checking one final each."""
    engine.scheduler.close_arrivals()
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return finals
        result = engine.step()
        engine.scheduler.check_invariants()
        for out in result.outputs:
            assert out.request_id not in finals, f"{out.request_id} got a second final event"
            if out.finished:
                finals[out.request_id] = out
    pytest.fail("engine did not finish")


# ---- every bad input is refused, naming the field -------------------------------------------

LONG_PROMPT = [1] * MAX_SEQ_LEN

# (id, add_request kwargs, error class, field, fragments the message must contain)
BAD_INPUTS = [
    ("empty-string-prompt", dict(prompt=""), InvalidRequestError, "prompt", ["token ids"]),
    ("empty-list-prompt", dict(prompt=[]), InvalidRequestError, "prompt", ["empty"]),
    (
        "prompt-too-long",
        dict(prompt=LONG_PROMPT, params={"max_tokens": 1}),
        RequestTooLongError,
        "prompt",
        ["64 tokens", "65", "limit of 64"],
    ),
    (
        "max-tokens-over-limit",
        dict(prompt=[1] * 10, params={"max_tokens": 60}),
        RequestTooLongError,
        "max_tokens",
        ["10 tokens", "60", "70", "limit of 64"],
    ),
    ("max-tokens-zero", dict(params={"max_tokens": 0}), InvalidRequestError, "max_tokens", ["greater than 0", "0"]),
    (
        "max-tokens-negative",
        dict(params={"max_tokens": -3}),
        InvalidRequestError,
        "max_tokens",
        ["greater than 0", "-3"],
    ),
    ("max-tokens-string", dict(params={"max_tokens": "10"}), InvalidRequestError, "max_tokens", ["integer", "'10'"]),
    ("max-tokens-bool", dict(params={"max_tokens": True}), InvalidRequestError, "max_tokens", ["integer"]),
    ("temperature-negative", dict(params={"temperature": -0.5}), InvalidRequestError, "temperature", ["-0.5"]),
    ("temperature-nan", dict(params={"temperature": math.nan}), InvalidRequestError, "temperature", ["nan"]),
    ("temperature-inf", dict(params={"temperature": math.inf}), InvalidRequestError, "temperature", ["finite"]),
    (
        "temperature-string",
        dict(params={"temperature": "hot"}),
        InvalidRequestError,
        "temperature",
        ["number", "'hot'"],
    ),
    ("top-p-zero", dict(params={"top_p": 0.0}), InvalidRequestError, "top_p", ["greater than 0"]),
    ("top-p-above-one", dict(params={"top_p": 1.5}), InvalidRequestError, "top_p", ["less than or equal to 1", "1.5"]),
    ("top-k-negative", dict(params={"top_k": -1}), InvalidRequestError, "top_k", ["-1"]),
    ("seed-string", dict(params={"seed": "x"}), InvalidRequestError, "seed", ["integer"]),
    ("stop-ints", dict(params={"stop": [1, 2]}), InvalidRequestError, "stop", ["strings", "int"]),
    ("stop-int", dict(params={"stop": 5}), InvalidRequestError, "stop", ["string", "int"]),
    ("stop-empty-string", dict(params={"stop": [""]}), InvalidRequestError, "stop", ["empty"]),
    ("stop-string-without-tokenizer", dict(params={"stop": "\n"}), InvalidRequestError, "stop", ["tokenizer"]),
    (
        "stop-token-ids-strings",
        dict(params={"stop_token_ids": ["a"]}),
        InvalidRequestError,
        "stop_token_ids.0",
        ["integer"],
    ),
    (
        "unknown-param",
        dict(params={"max_token": 3}),
        InvalidRequestError,
        "max_token",
        ["unknown parameter", "max_tokens"],
    ),
    ("params-string", dict(params="max_tokens=3"), InvalidRequestError, "params", ["dict", "str"]),
    ("params-list", dict(params=[("max_tokens", 3)]), InvalidRequestError, "params", ["dict", "list"]),
    ("prompt-int", dict(prompt=5), InvalidRequestError, "prompt", ["int"]),
    ("prompt-none", dict(prompt=None), InvalidRequestError, "prompt", ["NoneType"]),
    ("prompt-mixed-types", dict(prompt=[1, "a"]), InvalidRequestError, "prompt", ["token ids"]),
    ("prompt-floats", dict(prompt=[1.0, 2.0]), InvalidRequestError, "prompt", ["token ids"]),
    ("prompt-bools", dict(prompt=[True, False]), InvalidRequestError, "prompt", ["token ids"]),
    ("token-id-too-big", dict(prompt=[1, VOCAB]), InvalidRequestError, "prompt", [f"[0, {VOCAB})", str(VOCAB)]),
    ("token-id-negative", dict(prompt=[-1, 2]), InvalidRequestError, "prompt", [f"[0, {VOCAB})", "-1"]),
    ("request-id-empty", dict(request_id=""), InvalidRequestError, "request_id", ["non-empty string"]),
    ("request-id-int", dict(request_id=5), InvalidRequestError, "request_id", ["string", "5"]),
]


def submit_bad(engine: Engine, kwargs: dict, error, field: str, fragments: list[str]) -> None:
    kw = {"prompt": [1, 2, 3], "params": {"max_tokens": 4}, "request_id": "bad", **kwargs}
    with pytest.raises(error) as info:
        engine.add_request(**kw)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == field, f"error names {err.field!r}, expected {field!r}: {err}"
    message = str(err)
    assert field in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize(
    "kwargs,error,field,fragments", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_bad_input_rejected_and_engine_keeps_serving(kwargs, error, field, fragments):
    """Each bad input raises its typed error naming the field (with the given value or limit in
    the message), queues nothing, and the valid requests submitted before and after it are
    served in full."""
    engine, runner = make_engine()
    engine.add_request([3, 4, 5], {"max_tokens": 5, "ignore_eos": True}, request_id="before")
    submit_bad(engine, kwargs, error, field, fragments)
    engine.add_request([6, 7], {"max_tokens": 3, "ignore_eos": True}, request_id="after")
    assert set(engine.requests) == {"before", "after"} == queued_ids(engine)
    assert len(engine.scheduler.waiting) == 2

    finals = run_all(engine)
    assert set(finals) == {"before", "after"}
    assert all(f.finish_reason is FinishReason.LENGTH for f in finals.values())
    assert not engine.requests and not queued_ids(engine)
    assert engine.scheduler.slots.num_free_slots == 4


def test_empty_string_prompt_with_tokenizer_says_empty():
    """With a tokenizer, an empty string prompt is refused as empty (field `prompt`), and a
    non-empty string prompt is served."""
    engine, runner = make_engine(runner_cls=TokenizedRunner)
    submit_bad(engine, {"prompt": ""}, InvalidRequestError, "prompt", ["empty"])
    engine.add_request("hi", {"max_tokens": 2, "ignore_eos": True}, request_id="ok")
    finals = run_all(engine)
    assert finals["ok"].finish_reason is FinishReason.LENGTH


def test_too_long_names_kv_budget_when_it_binds():
    """When the K/V budget is below max_seq_len, the length limit is the budget and the error
    says so."""
    clock = FakeClock()
    engine = Engine(
        EngineConfig(policy="mixed", num_slots=2, max_seq_len=64, kv_budget_tokens=20),
        runner=ScriptedFakeRunner(clock, vocab_size=VOCAB),
        clock=clock,
    )
    with pytest.raises(RequestTooLongError) as info:
        engine.add_request([1] * 15, {"max_tokens": 6})
    assert info.value.field == "max_tokens" and "limit of 20" in str(info.value) and "budget 20" in str(info.value)
    engine.add_request([1] * 15, {"max_tokens": 5, "ignore_eos": True}, request_id="fits")  # exactly the limit
    assert run_all(engine)["fits"].finish_reason is FinishReason.LENGTH


def test_max_seq_len_capped_by_model_length():
    """An engine asked for slots longer than the model's context uses the model's context as the
    limit, and refuses requests beyond it."""
    clock = FakeClock()
    runner = ScriptedFakeRunner(clock, vocab_size=VOCAB, max_model_len=32)
    engine = Engine(EngineConfig(policy="mixed", num_slots=2, max_seq_len=512), runner=runner, clock=clock)
    assert engine.config.max_seq_len == 32
    with pytest.raises(RequestTooLongError, match="limit of 32"):
        engine.add_request([1] * 30, {"max_tokens": 3})


def test_duplicate_request_id_rejected_original_untouched():
    """A second request with the id of an unfinished one is refused (field request_id); the
    original still gets all its tokens and one final event; the id is free again once it ends."""
    engine, runner = make_engine()
    engine.add_request([1, 2, 3], {"max_tokens": 4, "ignore_eos": True}, request_id="dup")
    original = engine.requests["dup"]
    engine.step()
    submit_bad(engine, {"request_id": "dup", "prompt": [9, 9]}, InvalidRequestError, "request_id", ["dup", "already"])
    assert engine.requests["dup"] is original and len(engine.scheduler.running) == 1
    finals = run_all(engine)
    assert finals["dup"].finish_reason is FinishReason.LENGTH
    assert original.output_token_ids == runner.continuation([1, 2, 3], 4)

    engine.add_request([9, 9], {"max_tokens": 2, "ignore_eos": True}, request_id="dup")
    assert run_all(engine)["dup"].finish_reason is FinishReason.LENGTH


def test_bad_input_mid_run_does_not_disturb_running_requests():
    """Rejections between steps leave the running batch's tokens exactly as without them."""
    engine, runner = make_engine()
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7]}
    for rid, p in prompts.items():
        engine.add_request(p, {"max_tokens": 20, "ignore_eos": True}, request_id=rid)
    finished = []
    for case in BAD_INPUTS:
        finished += [o.request_id for o in engine.step().outputs if o.finished]
        with pytest.raises(InvalidRequestError):
            engine.add_request(**{"prompt": [1], "params": {"max_tokens": 2}, "request_id": "bad", **case[1]})
        assert "bad" not in queued_ids(engine)
    finished += list(run_all(engine))
    assert sorted(finished) == sorted(prompts)
    for rid, p in prompts.items():
        assert _SEEN[rid].output_token_ids == runner.continuation(p, 20)


_SEEN: dict[str, Request] = {}  # every Request queued in the current test, by id


@pytest.fixture(autouse=True)
def _remember_requests(monkeypatch):
    """Keep a handle on every queued Request so tests can read it after it finishes."""
    _SEEN.clear()
    original = Engine.add_request

    def add_request(self, *args, **kwargs):
        rid = original(self, *args, **kwargs)
        _SEEN[rid] = self.requests[rid]
        return rid

    monkeypatch.setattr(Engine, "add_request", add_request)


def test_params_with_non_string_key_is_invalid_request():
    """params={1: 2} is bad input: it must raise InvalidRequestError (field `params`), not TypeError."""
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([1, 2], {1: 2})
    assert info.value.field == "params"


def test_generate_with_one_bad_prompt_queues_nothing():
    """generate() with one bad prompt among good ones raises and leaves nothing queued, so the
    good ones do not run later as orphans nobody collects."""
    engine, _ = make_engine()
    with pytest.raises(InvalidRequestError):
        engine.generate([[1, 2], [], [3]], {"max_tokens": 2})
    assert not engine.requests and not queued_ids(engine)


def test_generate_still_works_after_rejections():
    """generate() on a clean engine returns every prompt's tokens in order."""
    engine, runner = make_engine()
    with pytest.raises(InvalidRequestError):
        engine.generate([[]], {"max_tokens": 2})
    done = engine.generate(
        [[1, 2], [3]], [{"max_tokens": 3, "ignore_eos": True}, {"max_tokens": 2, "ignore_eos": True}]
    )
    assert [c.token_ids for c in done] == [runner.continuation([1, 2], 3), runner.continuation([3], 2)]
    with pytest.raises(InvalidRequestError, match="2 params for 1 prompts"):
        engine.generate([[1]], [{"max_tokens": 1}, {"max_tokens": 1}])


# ---- a failing step ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_runner_error_fails_only_that_steps_requests(policy):
    """When the runner raises in a step, exactly the requests that ran in that step end with
    FinishReason.ERROR and the error message, their slots are freed, a request still waiting
    is untouched, and requests that come later complete normally."""
    engine, runner = make_engine(policy, runner_cls=FailingRunner, num_slots=2, fail_at=1)
    for rid, n in (("a", 5), ("b", 6), ("c", 7)):  # c waits: only two slots
        engine.add_request([1, 2, rid == "a" and 3 or 4], {"max_tokens": n, "ignore_eos": True}, request_id=rid)
    engine.scheduler.close_arrivals()
    first = engine.step()
    assert first.record is not None and not any(o.finished for o in first.outputs)
    failed = engine.step()
    engine.scheduler.check_invariants()
    assert sorted(runner.failed_request_ids) == ["a", "b"]
    assert sorted(o.request_id for o in failed.outputs) == ["a", "b"]
    for out in failed.outputs:
        assert out.finished and out.finish_reason is FinishReason.ERROR
        assert out.new_token_ids == []
        assert out.error == "RuntimeError: injected device failure"
        assert _SEEN[out.request_id].error == out.error
    assert failed.record is not None
    assert "a" not in engine.requests and "b" not in engine.requests
    assert engine.scheduler.slots.num_free_slots == 2 and engine.scheduler.slots.used_kv_tokens == 0

    engine.add_request([8, 9], {"max_tokens": 3, "ignore_eos": True}, request_id="d")
    finals = run_all(engine)
    assert set(finals) == {"c", "d"}
    assert all(f.finish_reason is FinishReason.LENGTH and f.error is None for f in finals.values())
    assert _SEEN["c"].output_token_ids == runner.continuation([1, 2, 4], 7)
    assert _SEEN["d"].output_token_ids == runner.continuation([8, 9], 3)
    failed = _SEEN["a"]
    assert failed.finish_reason is FinishReason.ERROR and "injected" in failed.error
    assert len(failed.output_token_ids) == 1  # the one token made before the failure


# ---- the sampler ------------------------------------------------------------------------


def req(rid: str = "r", **params) -> Request:
    return Request(rid, [0], SamplingParams(**params), 0.0)


LOGITS = torch.tensor(
    [
        [0.1, 2.0, -1.0, 0.5, 1.9],
        [3.0, -2.0, 0.0, 2.5, 1.0],
        [-1.0, -0.5, -3.0, -0.4, -2.0],
    ]
)


@pytest.mark.parametrize("kernel", [False, True])
def test_sampler_greedy_is_argmax(kernel):
    """Greedy rows (temperature 0) take each row's argmax, with the C++ argmax or torch's."""
    if kernel:
        if not shutil.which("c++"):
            pytest.skip("no C++ compiler: the kernels are not built and torch's argmax serves")
        assert fused_ops.available("cpu")
    tokens = Sampler(seed=0, kernel=kernel).sample(LOGITS, [req("a"), req("b"), req("c")])
    assert tokens == [1, 0, 3]
    assert tokens == LOGITS.argmax(dim=-1).tolist()


def test_sampler_top_k_one_is_greedy():
    """top_k=1 keeps only the best token, so sampling at any temperature equals greedy."""
    sampler = Sampler(seed=0)
    requests = [req(f"r{i}", temperature=t, top_k=1) for i, t in enumerate((0.5, 1.0, 5.0))]
    for _ in range(20):
        assert sampler.sample(LOGITS, requests) == [1, 0, 3]


def test_sampler_top_k_keeps_only_k_best():
    """top_k=2 draws only from the two best tokens of the row."""
    sampler = Sampler(seed=0)
    flat = torch.zeros(1, 10)
    flat[0, 4], flat[0, 7] = 0.2, 0.1
    drawn = {sampler.sample(flat, [req(temperature=1.0, top_k=2)])[0] for _ in range(100)}
    assert drawn == {4, 7}


def sample_on(sampler: Sampler, logits: torch.Tensor, rows: list[Request], steps: int) -> list[list[int]]:
    """`steps` draws, each token appended to its request's output as the engine does."""
    drawn = []
    for _ in range(steps):
        tokens = sampler.sample(logits[: len(rows)], rows)
        for r, t in zip(rows, tokens):
            r.output_token_ids.append(t)
        drawn.append(tokens)
    return drawn


def test_sampler_seed_reproducible():
    """A request's seed makes its draws reproducible across samplers (whatever their own seeds and
    whatever other rows share the batch); a different seed gives different draws."""
    flat = torch.zeros(2, 100)

    def draws(sampler_seed: int, request_seed: int, neighbour: bool) -> list[int]:
        r = req("x", temperature=1.0, seed=request_seed)
        rows = [r, req("n", temperature=1.0)] if neighbour else [r]
        return [t[0] for t in sample_on(Sampler(seed=sampler_seed), flat, rows, 30)]

    first = draws(0, 1234, False)
    assert draws(99, 1234, True) == first
    assert draws(0, 4321, False) != first
    assert len(set(first)) > 10  # really sampled from the flat distribution


def test_seeded_request_resumed_elsewhere_continues_its_sequence():
    """A seeded request moved to another replica after 6 tokens (it arrives there with them as
    output, `Request.resume_from`) draws the same tokens 7-15 as the undisturbed request: the
    draw at a position depends on the seed and the position only."""
    flat = torch.zeros(1, 100)
    whole = [t[0] for t in sample_on(Sampler(seed=0), flat, [req("x", temperature=1.0, seed=7)], 15)]
    moved = req("x", temperature=1.0, seed=7)
    moved.resume_from(whole[:6], "")
    assert [t[0] for t in sample_on(Sampler(seed=99), flat, [moved], 9)] == whole[6:]
    assert len(set(whole)) > 5  # really sampled


def test_sampler_small_top_p_keeps_top_token():
    """A small top_p keeps only the most likely token, even at a high temperature."""
    sampler = Sampler(seed=0)
    requests = [req(f"r{i}", temperature=2.0, top_p=0.05) for i in range(3)]
    for _ in range(30):
        assert sampler.sample(LOGITS, requests) == [1, 0, 3]


def test_sampler_top_p_keeps_nucleus():
    """top_p keeps the smallest set of best tokens whose mass reaches it: with probabilities
    0.5, 0.3, 0.2 and top_p=0.7, only the first two are ever drawn."""
    sampler = Sampler(seed=0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    drawn = {sampler.sample(logits, [req(temperature=1.0, top_p=0.7)])[0] for _ in range(200)}
    assert drawn == {0, 1}


def test_sampler_mixed_greedy_and_temperature_rows():
    """In one batch, greedy rows take the argmax while temperature rows really sample (with the
    same draws as when sampled alone, given their seed)."""
    flat_row = torch.zeros(1, 5)
    batch = torch.cat([LOGITS[:1], flat_row, LOGITS[2:]])
    rows = [req("g1"), req("t", temperature=1.0, seed=3), req("g2")]
    got = sample_on(Sampler(seed=0), batch, rows, 40)
    assert all(t[0] == 1 and t[2] == 3 for t in got)
    assert len({t[1] for t in got}) > 1, "the temperature row never varied"

    alone = sample_on(Sampler(seed=5), flat_row, [req("t", temperature=1.0, seed=3)], 40)
    assert [t[0] for t in alone] == [t[1] for t in got]
