# Over 400 lines: every batching policy's behaviours against one scripted fake model and clock.
"""Scheduler invariants and policy behaviour, on a scripted fake model and a fake clock.

Every run drives the engine step by step, calls `check_invariants()` after every step and
checks on its own that slots are never shared, every token is streamed once and in order
(replayed against the fake model, whose next token is a function of the sequence's
content), and every request ends with exactly one final event. The runs over a workload go
through the slot cache and the paged cache (with and without prefix caching), whose
check_invariants() also checks block reference counts, free lists and block tables.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest

from protocol.clock import FakeClock
from replica.config import EngineConfig
from replica.engine import Engine, StepRecord
from replica.errors import InvariantViolation
from replica.model.fake import ScriptedFakeRunner
from replica.scheduling.policies import POLICIES
from replica.scheduling.request import FinishReason, Request, RequestStatus

ALL_POLICIES = sorted(POLICIES)
# K/V cache layouts every workload-level test runs on; small blocks so short prompts span several.
KV_MODES = {
    "slot": {},
    "paged": {"kv_cache": "paged", "block_size": 4},
    "prefix": {"kv_cache": "paged", "block_size": 4, "prefix_caching": True},
}
VOCAB = 50
EOS = 7
STEP_SECONDS = 0.02  # FlatCostModel's default


# ---- workload and driver -----------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    request_id: str
    arrival: float
    prompt: list[int]
    params: dict
    oracle_output_len: int | None = None


def mixed_workload(n: int = 30, seed: int = 0, max_total: int = 64) -> list[Spec]:
    """Prompts of 1-40 tokens, max_tokens 1-30 (prompt + max_tokens <= max_total), EOS ignored by
    about a third, a few stop token ids, arrivals spread over about one second."""
    rng = random.Random(seed)
    specs = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(30.0)
        prompt_len = rng.randint(1, 40)
        max_tokens = rng.randint(1, min(30, max_total - prompt_len))
        params: dict = {"max_tokens": max_tokens, "ignore_eos": rng.random() < 0.35}
        if rng.random() < 0.2:
            params["stop_token_ids"] = [rng.randrange(VOCAB)]
        specs.append(Spec(f"r{i:02d}", round(t, 4), [rng.randrange(VOCAB) for _ in range(prompt_len)], params))
    return specs


@dataclass
class Run:
    engine: Engine
    runner: ScriptedFakeRunner
    requests: dict[str, Request] = field(default_factory=dict)
    streamed: dict[str, list[int]] = field(default_factory=dict)
    finals: dict[str, object] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)

    @property
    def num_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.records)

    def outputs(self) -> dict[str, tuple[list[int], FinishReason]]:
        return {rid: (list(r.output_token_ids), r.finish_reason) for rid, r in self.requests.items()}


def make_engine(
    policy: str,
    num_slots: int = 4,
    max_seq_len: int = 64,
    kv_budget_tokens: int | None = None,
    eos: int | None = EOS,
    **config,
) -> tuple[Engine, ScriptedFakeRunner, FakeClock]:
    clock = FakeClock()
    runner = ScriptedFakeRunner(clock, vocab_size=VOCAB, eos_token_id=eos)
    cfg = EngineConfig(
        policy=policy, num_slots=num_slots, max_seq_len=max_seq_len, kv_budget_tokens=kv_budget_tokens, **config
    )
    return Engine(cfg, runner=runner, clock=clock), runner, clock


def check_slots(engine: Engine) -> None:
    """Our own check, independent of check_invariants(): no slot held twice, slots conserved."""
    sched = engine.scheduler
    holders = [*sched.running, *sched.held]
    slots = [r.slot for r in holders]
    assert None not in slots, f"a running or held request has no slot: {[r.request_id for r in holders]}"
    assert len(slots) == len(set(slots)), f"a slot is held by two requests: {slots}"
    assert all(0 <= s < sched.config.num_slots for s in slots)
    assert sched.slots.num_free_slots + sched.slots.num_used_slots == sched.config.num_slots
    assert sched.slots.num_used_slots == len(holders)
    assert all(r.slot is None for r in sched.waiting)
    assert 0 <= sched.slots.used_kv_tokens <= sched.slots.kv_budget_tokens


def drive(
    engine: Engine, runner: ScriptedFakeRunner, clock: FakeClock, specs: list[Spec], max_steps: int = 20_000
) -> Run:
    """Submit each spec when the fake clock passes its arrival, step until all are done, and
    check every invariant after every step."""
    run = Run(engine, runner)
    pending = sorted(specs, key=lambda s: s.arrival)
    i = 0
    for _ in range(max_steps):
        while i < len(pending) and pending[i].arrival <= clock.now():
            s = pending[i]
            engine.add_request(s.prompt, s.params, request_id=s.request_id, oracle_output_len=s.oracle_output_len)
            run.requests[s.request_id] = engine.requests[s.request_id]
            run.streamed[s.request_id] = []
            i += 1
        if i == len(pending):
            engine.scheduler.close_arrivals()
        if i == len(pending) and not engine.has_unfinished:
            break
        result = engine.step()
        engine.scheduler.check_invariants()
        check_slots(engine)
        seen_this_step = set()
        for out in result.outputs:
            rid = out.request_id
            assert rid not in seen_this_step, f"{rid} got two outputs in one step"
            seen_this_step.add(rid)
            assert rid not in run.finals, f"{rid} emitted after its final event"
            req = run.requests[rid]
            for token in out.new_token_ids:
                expected = runner.next_token(req.prompt_token_ids + run.streamed[rid])
                assert token == expected, f"{rid}: streamed {token}, the model makes {expected} here"
                run.streamed[rid].append(token)
            assert len(run.streamed[rid]) <= req.params.max_tokens
            if out.finished:
                assert out.finish_reason is not None, f"{rid} finished without a reason"
                run.finals[rid] = out
            else:
                assert out.finish_reason is None
        if result.record is not None:
            run.records.append(result.record)
            continue
        # Nothing could run: move the fake clock to the next arrival or the policy's timer.
        events = [pending[i].arrival] if i < len(pending) else []
        wake = engine.scheduler.wake_time()
        if wake is not None and wake > clock.now():
            events.append(wake)
        assert events, (
            f"{engine.scheduler.name}: stuck with nothing to wait for: waiting "
            f"{[r.request_id for r in engine.scheduler.waiting]}, running "
            f"{[r.request_id for r in engine.scheduler.running]}, held {[r.request_id for r in engine.scheduler.held]}"
        )
        clock.sleep(max(0.0, min(events) - clock.now()))
    else:
        pytest.fail(f"{engine.scheduler.name}: did not finish in {max_steps} steps")
    return run


def check_finished_run(run: Run, specs: list[Spec]) -> None:
    """Every request ended exactly once, with a reason that matches its tokens."""
    assert set(run.finals) == {s.request_id for s in specs}, "some request got no final event"
    assert not run.engine.requests
    sched = run.engine.scheduler
    assert not sched.waiting and not sched.running and not sched.held
    assert sched.slots.num_free_slots == sched.config.num_slots and sched.slots.used_kv_tokens == 0
    if sched.config.kv_cache == "paged":  # every block back on a free list (cached ones stay reusable there)
        assert sched.slots.blocks.num_free_blocks == sched.config.num_blocks
    for s in specs:
        req, final = run.requests[s.request_id], run.finals[s.request_id]
        assert req.is_finished and req.finish_reason is final.finish_reason
        assert run.streamed[s.request_id] == req.output_token_ids, f"{s.request_id}: streamed != final output"
        assert len(req.token_times) == req.num_output_tokens
        tokens, p = req.output_token_ids, req.params
        reason = final.finish_reason
        assert reason in (FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH), f"{s.request_id}: {reason}"
        assert 1 <= len(tokens) <= p.max_tokens
        if reason is FinishReason.LENGTH:
            assert len(tokens) == p.max_tokens
        if reason is FinishReason.EOS:
            assert tokens[-1] == EOS and not p.ignore_eos
        if reason is FinishReason.STOP:
            assert tokens[-1] in p.stop_token_ids
        # No earlier token should have ended it.
        for t in tokens[:-1]:
            assert t not in p.stop_token_ids and (p.ignore_eos or t != EOS)


# ---- invariants under every policy -------------------------------------------------------

SPECS = mixed_workload()
BIG = dict(num_slots=4, max_seq_len=64)  # default K/V budget: every slot full
TINY = dict(num_slots=4, max_seq_len=64, kv_budget_tokens=80)


def test_workload_exercises_every_finish_reason():
    """The mixed workload ends requests by EOS, by stop token and by length, and has
    ignore_eos requests run past an EOS token (so the runs below test all of these)."""
    engine, runner, clock = make_engine("mixed", **BIG)
    run = drive(engine, runner, clock, SPECS)
    reasons = {r.finish_reason for r in run.requests.values()}
    assert reasons == {FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH}
    # ignore_eos is honoured: some such request generated EOS and went on.
    assert any(s.params["ignore_eos"] and EOS in run.requests[s.request_id].output_token_ids[:-1] for s in SPECS)


@pytest.mark.parametrize("kv", KV_MODES)
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_invariants_hold_every_step(policy, kv):
    """Under every policy and cache layout, over a mixed workload with spread arrivals:
    invariants hold after every step, no slot is shared, tokens stream once each and in order,
    and each request gets exactly one final event whose reason matches its tokens."""
    engine, runner, clock = make_engine(policy, **BIG, token_budget=16, **KV_MODES[kv])
    run = drive(engine, runner, clock, SPECS)
    check_finished_run(run, SPECS)
    assert run.num_preemptions == 0  # the big cache never runs out
    assert sum(r.num_decode_tokens + r.num_prefill_tokens for r in run.records) >= sum(len(s.prompt) for s in SPECS)


@pytest.fixture(scope="module")
def reference_outputs():
    engine, runner, clock = make_engine("mixed", **BIG)
    return drive(engine, runner, clock, SPECS).outputs()


@pytest.mark.parametrize("kv", KV_MODES)
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_outputs_do_not_depend_on_policy(policy, kv, reference_outputs):
    """The fake model's tokens depend only on content, so every policy, on either cache,
    yields the same tokens and finish reasons as the mixed policy on the slot cache."""
    engine, runner, clock = make_engine(policy, **BIG, token_budget=16, **KV_MODES[kv])
    assert drive(engine, runner, clock, SPECS).outputs() == reference_outputs


@pytest.mark.parametrize("kv", KV_MODES)
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_preemption_replays_without_duplicates(policy, kv, reference_outputs):
    """With a K/V budget too small for the batch, requests are preempted (recompute) and later
    re-prefilled (with prefix caching, from their own blocks where still cached); invariants
    still hold every step, no token is streamed twice, and the outputs equal those of an
    un-preempted run."""
    engine, runner, clock = make_engine(policy, **TINY, token_budget=16, **KV_MODES[kv])
    run = drive(engine, runner, clock, SPECS)
    check_finished_run(run, SPECS)
    assert run.num_preemptions > 0, "the tiny cache should force preemptions"
    assert (
        run.num_preemptions == engine.scheduler.num_preemptions == sum(r.num_preemptions for r in run.requests.values())
    )
    assert run.outputs() == reference_outputs
    if kv == "prefix":  # a preempted request found its own computed blocks still cached
        assert engine.scheduler.num_prefix_cached_tokens > 0


@pytest.mark.parametrize("kv", KV_MODES)
@pytest.mark.parametrize("policy", ["static", "dynamic", "bucketed"])
def test_static_preemption_with_held_rows_does_not_deadlock(policy, kv):
    """A static batch whose finished (held) rows use most of the K/V budget still drains when
    the last running request must be preempted: two requests share an 8-token budget; the
    short one finishes and holds its 4 tokens, the long one then cannot grow and preempts
    itself. The held row must be released so the long one can be re-admitted and finish."""
    engine, runner, clock = make_engine(
        policy, num_slots=2, max_seq_len=8, kv_budget_tokens=8, eos=None, **KV_MODES[kv]
    )
    specs = [Spec("short", 0.0, [1, 2, 3], {"max_tokens": 2}, 2), Spec("long", 0.0, [4, 5], {"max_tokens": 6}, 6)]
    run = drive(engine, runner, clock, specs, max_steps=200)
    check_finished_run(run, specs)


# ---- policy-specific behaviour -----------------------------------------------------------


def add(engine: Engine, rid: str, prompt_len: int, max_tokens: int, **kw) -> Request:
    engine.add_request(
        list(range(1, prompt_len + 1)), {"max_tokens": max_tokens, "ignore_eos": True}, request_id=rid, **kw
    )
    return engine.requests[rid]


def step_checked(engine: Engine):
    result = engine.step()
    engine.scheduler.check_invariants()
    check_slots(engine)
    return result


def run_to_end(engine: Engine, max_steps: int = 1000) -> list[StepRecord]:
    engine.scheduler.close_arrivals()
    records = []
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return records
        result = step_checked(engine)
        assert result.record is not None, "nothing ran though arrivals are closed"
        records.append(result.record)
    pytest.fail("did not finish")


def test_static_admits_nothing_while_batch_runs_and_holds_finished_rows():
    """Static batching: a request that arrives while a batch runs waits until the whole batch
    is done, even after slots of finished requests are no longer useful; those finished rows
    are still computed (computed_rows > useful_rows)."""
    engine, _, clock = make_engine("static", num_slots=2, eos=None)
    a, b = add(engine, "a", 4, 2), add(engine, "b", 4, 10)
    engine.scheduler.close_arrivals()
    step_checked(engine)  # prefill both
    late = add(engine, "late", 3, 3)
    records = []
    while not b.is_finished:
        records.append(step_checked(engine).record)
        if not b.is_finished:
            assert late.status is RequestStatus.WAITING and late.slot is None
            assert late.num_output_tokens == 0
    assert a.is_finished and a.finish_reason is FinishReason.LENGTH
    assert any(r.computed_rows > r.useful_rows for r in records), "finished row of `a` not held"
    assert all(r.live_slots == 2 for r in records), "static batch released a slot mid-batch"
    # The batch drained: both slots are free again and `late` runs next.
    assert engine.scheduler.slots.num_free_slots == 2 and not engine.scheduler.held
    run_to_end(engine)
    assert late.num_output_tokens == 3


def test_static_waits_for_full_batch_unless_arrivals_closed():
    """Static batching does not start a partial batch while more requests may come, however long
    they wait; it starts one as soon as arrivals are closed, and a full batch starts at once."""
    engine, _, clock = make_engine("static", num_slots=3, eos=None)
    add(engine, "a", 2, 2)
    add(engine, "b", 2, 2)
    for _ in range(5):
        clock.sleep(10.0)
        assert step_checked(engine).record is None
    assert engine.scheduler.wake_time() is None
    engine.scheduler.close_arrivals()
    record = step_checked(engine).record
    assert record is not None and record.num_prefill_tokens == 4

    engine, _, _ = make_engine("static", num_slots=3, eos=None)
    for rid in "xyz":
        add(engine, rid, 2, 2)
    record = step_checked(engine).record  # arrivals still open, but the batch is full
    assert record is not None and record.useful_rows == 3


def test_dynamic_starts_partial_batch_after_max_wait():
    """Dynamic batching starts a partial batch exactly when the oldest waiting request has
    waited max_wait on the clock, and not a moment before; wake_time says when."""
    engine, _, clock = make_engine("dynamic", num_slots=4, eos=None, max_wait=0.5)
    clock.sleep(1.0)
    add(engine, "a", 3, 2)
    clock.sleep(0.25)
    add(engine, "b", 3, 2)
    assert engine.scheduler.wake_time() == pytest.approx(1.5)
    clock.sleep(0.2499)
    assert step_checked(engine).record is None
    clock.sleep(1.5 - clock.now())
    record = step_checked(engine).record
    assert record is not None and record.useful_rows == 2 and record.num_prefill_tokens == 6


def test_dynamic_starts_full_batch_without_waiting():
    """Dynamic batching, like static, starts at once when a full batch is waiting."""
    engine, _, clock = make_engine("dynamic", num_slots=2, eos=None, max_wait=100.0)
    add(engine, "a", 3, 2)
    assert step_checked(engine).record is None
    add(engine, "b", 3, 2)
    assert step_checked(engine).record is not None


def test_continuous_never_mixes_decode_and_prefill():
    """Continuous (prefill-first): a step with prefill tokens has no decode tokens, so running
    decodes stall while a new prompt is prefilled."""
    engine, _, clock = make_engine("continuous", num_slots=4, eos=None)
    add(engine, "a", 5, 6)
    records = [step_checked(engine).record, step_checked(engine).record]  # prefill, decode
    add(engine, "b", 7, 3)
    records += run_to_end(engine)
    assert all(r.num_decode_tokens == 0 for r in records if r.num_prefill_tokens > 0)
    assert [r.num_prefill_tokens for r in records][:3] == [5, 0, 7]
    assert records[2].num_decode_tokens == 0  # `a` stalled for `b`'s prefill


def test_mixed_does_mix_decode_and_prefill():
    """Mixed: a new prompt's prefill runs in the same step as the running decodes."""
    engine, _, clock = make_engine("mixed", num_slots=4, eos=None)
    add(engine, "a", 5, 6)
    step_checked(engine)
    step_checked(engine)
    add(engine, "b", 7, 3)
    record = step_checked(engine).record
    assert record.num_prefill_tokens == 7 and record.num_decode_tokens == 1


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_mixing_follows_policy_over_workload(policy):
    """Over the mixed workload, only mixed and chunked put decodes and prefill in one step;
    continuous never does."""
    engine, runner, clock = make_engine(policy, **BIG, token_budget=16)
    run = drive(engine, runner, clock, SPECS)
    mixed_steps = [r for r in run.records if r.num_prefill_tokens and r.num_decode_tokens]
    if policy == "continuous":
        assert not mixed_steps
    elif policy in ("mixed", "chunked"):
        assert mixed_steps


def test_chunked_respects_token_budget_and_splits_long_prompt():
    """Chunked: no step runs more than token_budget tokens; a prompt longer than the budget is
    prefilled over several steps and samples only after its last chunk."""
    engine, runner, clock = make_engine("chunked", num_slots=4, eos=None, token_budget=8)
    a = add(engine, "a", 3, 10)
    step_checked(engine)
    long = add(engine, "long", 30, 4)
    records = []
    while long.num_output_tokens == 0:
        result = step_checked(engine)
        records.append(result.record)
        assert all(o.request_id != "long" for o in result.outputs) or long.num_computed_tokens == 30
    # 7 prompt tokens per step next to `a`'s one decode token.
    assert [(r.num_decode_tokens, r.num_prefill_tokens) for r in records] == [(1, 7)] * 4 + [(1, 2)]
    records += run_to_end(engine)
    assert all(r.num_decode_tokens + r.num_prefill_tokens <= 8 for r in records)
    assert a.num_output_tokens == 10 and long.num_output_tokens == 4
    assert long.output_token_ids[0] == runner.next_token(list(range(1, 31)))


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_token_budget_only_binds_chunked(policy):
    """Over the workload, chunked never runs more than token_budget tokens in a step; the other
    policies ignore the budget (some step runs more)."""
    engine, runner, clock = make_engine(policy, num_slots=8, max_seq_len=64, token_budget=16)
    # All at once so that whole batches of prompts are prefilled together.
    specs = [Spec(s.request_id, 0.0, s.prompt, s.params) for s in SPECS]
    run = drive(engine, runner, clock, specs)
    check_finished_run(run, specs)
    biggest = max(r.num_decode_tokens + r.num_prefill_tokens for r in run.records)
    if policy == "chunked":
        assert biggest <= 16
    else:
        assert biggest > 16


def test_bucketed_admits_shortest_oracle_lengths_first():
    """Bucketed (oracle): the first batch is the requests with the shortest oracle_output_len,
    whatever their arrival order; max_tokens stands in when no oracle length is given."""
    engine, _, clock = make_engine("bucketed", num_slots=2, eos=None)
    lens = {"a": 30, "b": 5, "c": 20, "d": 3}
    for rid, n in lens.items():
        engine.add_request([1, 2, 3], {"max_tokens": 30, "ignore_eos": True}, request_id=rid, oracle_output_len=n)
    first = step_checked(engine)
    assert sorted(r.request_id for r in engine.scheduler.running) == ["b", "d"]
    assert first.record.useful_rows == 2

    engine, _, clock = make_engine("bucketed", num_slots=2, eos=None)
    for rid, n in (("x", 9), ("y", 2), ("z", 4)):
        add(engine, rid, 3, n)  # no oracle length: max_tokens orders them
    step_checked(engine)
    assert sorted(r.request_id for r in engine.scheduler.running) == ["y", "z"]


def test_static_admits_in_arrival_order():
    """Plain static (no oracle) admits in arrival order: the contrast to bucketed."""
    engine, _, clock = make_engine("static", num_slots=2, eos=None)
    for rid, n in (("a", 30), ("b", 5), ("c", 20), ("d", 3)):
        engine.add_request([1, 2, 3], {"max_tokens": 30, "ignore_eos": True}, request_id=rid, oracle_output_len=n)
    step_checked(engine)
    assert sorted(r.request_id for r in engine.scheduler.running) == ["a", "b"]


# ---- prefix caching (paged cache) -----------------------------------------------------------


def shared_prefix_workload(n: int = 24, seed: int = 1) -> list[Spec]:
    """Prompts made of one of two system prompts (21 and 10 tokens) and a 1-12 token question,
    arriving over about a second, so later requests find earlier ones' blocks cached."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(k)] for k in (21, 10)]
    specs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(20.0)
        prompt = rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        specs.append(Spec(f"p{i:02d}", round(t, 4), prompt, {"max_tokens": rng.randint(1, 20), "ignore_eos": True}))
    return specs


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_prefix_caching_keeps_outputs_and_saves_exactly_the_cached_prefill(policy):
    """Requests sharing system prompts, with prefix caching: invariants hold every step (shared
    blocks' reference counts included), tokens equal the slot cache's, and the prefill tokens
    computed drop by exactly the tokens admission found cached."""
    specs = shared_prefix_workload()
    runs = {kv: drive(*make_engine(policy, **BIG, token_budget=16, **KV_MODES[kv]), specs) for kv in ("slot", "prefix")}
    for run in runs.values():
        check_finished_run(run, specs)
    assert runs["prefix"].outputs() == runs["slot"].outputs()
    cached = runs["prefix"].engine.scheduler.num_prefix_cached_tokens
    assert cached > 0 and runs["prefix"].num_preemptions == runs["slot"].num_preemptions == 0
    prefill = {kv: sum(r.num_prefill_tokens for r in run.records) for kv, run in runs.items()}
    assert prefill["slot"] == sum(len(s.prompt) for s in specs)
    assert prefill["prefix"] == prefill["slot"] - cached


def test_shared_system_prompt_is_computed_once():
    """Three requests arriving while the first decodes take its 5 full system-prompt blocks by
    reference (ref count 4 each) and prefill only their own questions; the blocks are freed
    only when the last of them ends, and stay cached for a later request after that."""
    system = list(range(1, 41))  # 40 tokens = 5 blocks of 8
    engine, runner, _ = make_engine(
        "mixed", num_slots=4, max_seq_len=64, eos=None, kv_cache="paged", block_size=8, prefix_caching=True
    )
    first = engine.requests[engine.add_request(system + [41, 42], {"max_tokens": 8, "ignore_eos": True})]
    assert step_checked(engine).record.num_prefill_tokens == 42
    others = [
        engine.requests[engine.add_request(system + [43 + i] * (i + 1), {"max_tokens": 3, "ignore_eos": True})]
        for i in range(3)
    ]
    record = step_checked(engine).record
    assert record.num_prefill_tokens == 1 + 2 + 3 and record.num_decode_tokens == 1
    shared = first.block_table[:5]
    assert all(r.block_table[:5] == shared for r in others)
    blocks = engine.scheduler.slots.blocks
    assert [blocks.blocks[b].ref_count for b in shared] == [4] * 5
    run_to_end(engine)
    assert all(r.output_token_ids[0] == runner.next_token(r.prompt_token_ids) for r in [first, *others])
    assert all(blocks.blocks[b].ref_count == 0 and blocks.blocks[b].hash is not None for b in shared)
    late = engine.requests[engine.add_request(system + [49], {"max_tokens": 2, "ignore_eos": True})]
    assert step_checked(engine).record.num_prefill_tokens == 1 and late.block_table[:5] == shared
    assert engine.scheduler.num_prefix_cached_tokens == 4 * 40


# ---- abort --------------------------------------------------------------------------------


@pytest.mark.parametrize("kv", KV_MODES)
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_abort_waiting_and_running(policy, kv):
    """Aborting a waiting and a running request gives each exactly one final event with reason
    ABORT, removes it from every queue, and frees its slot (a static batch frees it when the
    batch drains); the others finish normally and nothing more is emitted for the aborted."""
    engine, runner, clock = make_engine(policy, num_slots=2, eos=None, max_wait=0.0, **KV_MODES[kv])
    run_r = add(engine, "run", 4, 10)
    other = add(engine, "other", 4, 3)
    step_checked(engine)
    step_checked(engine)
    wait_r = add(engine, "wait", 4, 5)
    assert run_r.status is RequestStatus.RUNNING and wait_r.status is RequestStatus.WAITING

    out = engine.abort("wait")
    assert out.finished and out.finish_reason is FinishReason.ABORT and out.new_token_ids == []
    assert wait_r not in engine.scheduler.waiting and "wait" not in engine.requests
    engine.scheduler.check_invariants()

    emitted_before = run_r.num_output_tokens
    slot = run_r.slot
    out = engine.abort("run")
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert run_r.finish_reason is FinishReason.ABORT and run_r not in engine.scheduler.running
    assert "run" not in engine.requests
    engine.scheduler.check_invariants()
    check_slots(engine)
    if engine.scheduler.holds_finished_rows:
        assert engine.scheduler.slots.owner(slot) is run_r  # held until the batch drains
    else:
        assert engine.scheduler.slots.owner(slot) is None and run_r.slot is None

    assert engine.abort("run") is None and engine.abort("wait") is None and engine.abort("nope") is None
    finals = []
    engine.scheduler.close_arrivals()
    while engine.has_unfinished:
        result = step_checked(engine)
        assert all(o.request_id == "other" for o in result.outputs)
        finals += [o for o in result.outputs if o.finished]
    assert [o.finish_reason for o in finals] == [FinishReason.LENGTH]
    assert other.num_output_tokens == 3 and run_r.num_output_tokens == emitted_before
    assert engine.scheduler.slots.num_free_slots == 2 and engine.scheduler.slots.used_kv_tokens == 0


# ---- the checks themselves can fail --------------------------------------------------------


def _running_engine(**kv) -> Engine:
    engine, _, _ = make_engine("mixed", num_slots=3, eos=None, **kv)
    add(engine, "a", 3, 5)
    add(engine, "b", 3, 5)
    step_checked(engine)
    return engine


def test_check_invariants_catches_slot_freed_twice():
    """check_invariants() raises InvariantViolation when a slot is pushed on the free heap twice."""
    engine = _running_engine()
    slots = engine.scheduler.slots
    heapq.heappush(slots._free, slots._free[0])
    with pytest.raises(InvariantViolation, match="free twice"):
        engine.scheduler.check_invariants()


def test_check_invariants_catches_slot_both_free_and_owned():
    """check_invariants() raises when an owned slot is also on the free heap."""
    engine = _running_engine()
    slots = engine.scheduler.slots
    heapq.heappush(slots._free, engine.scheduler.running[0].slot)
    with pytest.raises(InvariantViolation):
        engine.scheduler.check_invariants()


def test_check_invariants_catches_request_in_two_queues():
    """check_invariants() raises when a running request is also queued as waiting."""
    engine = _running_engine()
    engine.scheduler.waiting.append(engine.scheduler.running[0])
    with pytest.raises(InvariantViolation):
        engine.scheduler.check_invariants()


@pytest.mark.parametrize("kv", KV_MODES)
def test_check_invariants_catches_kv_miscount(kv):
    """check_invariants() raises when the K/V token count disagrees with the reservations (slots)
    or with the blocks in use (paged)."""
    engine = _running_engine(**KV_MODES[kv])
    engine.scheduler.slots.used_kv_tokens += 1
    with pytest.raises(InvariantViolation, match="K/V"):
        engine.scheduler.check_invariants()


def test_check_invariants_catches_wrong_slot_on_request():
    """check_invariants() raises when a request's idea of its slot disagrees with the table."""
    engine = _running_engine()
    a, b = engine.scheduler.running
    a.slot, b.slot = b.slot, a.slot
    with pytest.raises(InvariantViolation):
        engine.scheduler.check_invariants()


def _prefix_engine() -> Engine:
    """Two running requests that share a cached 8-token block."""
    engine, _, _ = make_engine("mixed", num_slots=3, eos=None, kv_cache="paged", block_size=4, prefix_caching=True)
    add(engine, "a", 9, 5)
    step_checked(engine)
    add(engine, "b", 9, 5)
    step_checked(engine)
    return engine


def test_check_invariants_catches_block_ref_count_off():
    """check_invariants() raises when a block's reference count is not the number of tables holding it."""
    engine = _prefix_engine()
    a, b = engine.scheduler.running
    assert a.block_table[:2] == b.block_table[:2]  # the shared prefix
    engine.scheduler.slots.blocks.blocks[a.block_table[0]].ref_count -= 1
    with pytest.raises(InvariantViolation, match="ref_count"):
        engine.scheduler.check_invariants()


def test_check_invariants_catches_referenced_block_on_free_list():
    """check_invariants() raises when a block some table holds is also on a free list."""
    engine = _prefix_engine()
    engine.scheduler.slots.blocks._free.append(engine.scheduler.running[0].block_table[-1])
    with pytest.raises(InvariantViolation, match="free"):
        engine.scheduler.check_invariants()


def test_check_invariants_catches_block_cached_for_another_prefix():
    """check_invariants() raises when a request's table holds a cached block whose hash is not
    that of the request's own prefix at that position."""
    engine = _prefix_engine()
    engine.scheduler.running[1].block_hashes[1] += 1
    with pytest.raises(InvariantViolation, match="another prefix"):
        engine.scheduler.check_invariants()
