"""Reliability without Ray: the replica's serving loop bounds its queue, reports a stalled or
failed loop as unhealthy, hands back what it holds when its loop fails or it drains, and
resumes a request another replica started; the router bounds what it sends and skips replicas
marked down; bad input (a seed past 64 bits, a lone surrogate, an unknown routing policy) is
a clear error naming the field before anything starts."""

from __future__ import annotations

import asyncio
import threading

import pytest

from protocol.clock import FakeClock
from protocol.errors import DrainingError, OverloadedError
from protocol.replicas import Resume
from protocol.routing import RouteRequest
from replica import Engine, EngineConfig, InvalidRequestError
from replica.model.fake import FlatCostModel, ScriptedFakeRunner
from replica.scheduling.request import MAX_SEED, SamplingParams, validate_prompt
from replica.scheduling.scheduler import SchedulerOutput
from replica.serving.loop import AsyncEngine
from router.router import Router


class HeldRunner(ScriptedFakeRunner):
    """The fake model on a FakeClock whose steps can be held: while `gate` is clear a step
    blocks in the engine's worker thread, so a test looks at the loop in the middle of a step
    (and moves the clock on) without waiting on the wall clock."""

    def __init__(self, clock: FakeClock, step: float):
        super().__init__(clock, FlatCostModel(step))
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # a step has started

    def execute(self, out: SchedulerOutput) -> list[int]:
        self.entered.set()
        if not self.gate.wait(timeout=60):
            raise TimeoutError("the test never released the held step")
        return super().execute(out)

    async def held_step(self) -> None:
        """Hold the next step and return once it has started."""
        self.gate.clear()
        self.entered.clear()
        await asyncio.to_thread(self.entered.wait, 60)


def serving(step: float = 0.002, slots: int = 2, **kw) -> tuple[AsyncEngine, HeldRunner]:
    clock = FakeClock()
    runner = HeldRunner(clock, step)
    return AsyncEngine(Engine(EngineConfig(num_slots=slots, max_seq_len=256), runner, clock), **kw), runner


async def settled() -> None:
    """Let every task ready to run reach its next await (a turn of the event loop, no wall time)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_seed_past_64_bits_names_the_field_and_the_limit():
    """A seed torch cannot take (it failed every request of the step) is refused at validation."""
    with pytest.raises(InvalidRequestError, match=f"seed.*{MAX_SEED}.*1180591620717411303424"):
        SamplingParams.parse({"seed": 1180591620717411303424, "temperature": 0.7})
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams.parse({"seed": -1})
    assert SamplingParams.parse({"seed": MAX_SEED}).seed == MAX_SEED


def test_lone_surrogate_and_junk_prompts_are_invalid_requests():
    """What undecodable argv bytes become (a lone surrogate) is an InvalidRequestError naming the
    prompt and the position, as are bools and negative numbers posing as token ids."""
    with pytest.raises(InvalidRequestError, match=r"prompt: is not valid UTF-8.*index 2"):
        validate_prompt("hi\udcff there")
    for junk in ([True, 2], [1, -3], [1.5], {"a": 1}, None):
        with pytest.raises(InvalidRequestError, match="prompt"):
            validate_prompt(junk)


def test_cli_refuses_bad_seed_surrogate_and_routing_before_starting_anything(capsys):
    """`generate --seed 2**70` and a surrogate prompt exit 2 with the field named (nothing is
    loaded); `up --routing bogus` exits 2 listing the policies, before Ray is started."""
    import ray

    from cli.main import main

    assert main(["generate", "--local", "--seed", "1180591620717411303424", "--temperature", "0.7", "Hi"]) == 2
    assert "seed" in capsys.readouterr().err
    assert main(["generate", "--local", "bad\udcffbytes"]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err
    assert main(["up", "--routing", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown routing policy 'bogus'" in err and "least_loaded" in err and "Traceback" not in err
    assert not ray.is_initialized()


def test_full_waiting_queue_refuses_at_once_with_retry_after():
    """Past max_queue waiting requests a submission gets OverloadedError immediately (naming the
    replica and the bound, with a retry-after hint); the ones accepted all finish."""

    async def main():
        s, runner = serving(step=0.02, slots=1, max_queue=2)
        held = asyncio.create_task(runner.held_step())
        accepted = [asyncio.create_task(_collect(s, [1], 10, "r0"))]
        await held  # r0 runs, its step held
        accepted += [asyncio.create_task(_collect(s, [i + 1], 3, f"r{i}")) for i in (1, 2)]
        await settled()
        assert s.engine.num_running == 1 and s.queued == 2
        with pytest.raises(OverloadedError) as err:
            await s.submit([9], {"max_tokens": 5}, "over", None, lambda out: None)
        assert err.value.where == "replica" and err.value.limit == 2 and err.value.retry_after > 0
        runner.gate.set()
        outs = await asyncio.gather(*accepted)
        assert [o[-1].finish_reason.value for o in outs] == ["length"] * 3
        assert s.peak_queued <= 2 and s.rejected == 1

    asyncio.run(main())


async def _collect(s: AsyncEngine, prompt, n, rid, **kw):
    return [o async for o in s.generate(prompt, {"max_tokens": n, "ignore_eos": True, **kw}, rid)]


def test_stalled_step_is_unhealthy_and_healthy_again_after():
    """A step running past stall_timeout with work held makes health() unhealthy, naming the stall."""

    async def main():
        s, runner = serving(step=0.6, stall_timeout=0.2)
        held = asyncio.create_task(runner.held_step())
        task = asyncio.create_task(_collect(s, [1], 1, "slow"))
        await held
        assert s.health().healthy  # inside the step, within the stall limit
        s.clock.advance(0.4)
        h = s.health()
        assert not h.healthy and "stall" in h.reason and h.last_step_age == pytest.approx(0.4) and h.running == 1
        runner.gate.set()
        await task
        assert s.health().healthy

    asyncio.run(main())


def test_failed_loop_is_unhealthy_and_hands_its_requests_back():
    """A loop that raises (not a model error: those fail only their step) reports its error and
    ends every request it held with `migrate`, so their clients continue them elsewhere; new
    submissions are refused."""

    async def main():
        s, runner = serving(step=0.01, slots=3)
        held = asyncio.create_task(runner.held_step())
        tasks = [asyncio.create_task(_collect(s, [i + 1], 50, f"r{i}")) for i in range(3)]
        await held  # all three admitted, the first step held

        def broken():
            raise RuntimeError("scheduler state corrupted")

        s.engine.step = broken
        runner.gate.set()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert {o[-1].finish_reason.value for o in outs} == {"migrate"}
        h = s.health()
        assert not h.healthy and "scheduler state corrupted" in h.loop_error
        with pytest.raises(DrainingError):
            await s.submit([1], {"max_tokens": 2}, "late", None, lambda out: None)

    asyncio.run(main())


def test_drain_finishes_what_fits_and_hands_back_the_rest():
    """drain(): no admissions, short requests finish, long ones come back as `migrate` at the
    timeout, on the engine's clock: 0.3 s is 30 steps of 0.01 s, so the 10-token request ends
    and the 200-token one has about 30 tokens when it is handed back."""

    async def main():
        s, runner = serving(step=0.01, slots=4)
        held = asyncio.create_task(runner.held_step())
        short = asyncio.create_task(_collect(s, [1], 10, "short"))
        long = asyncio.create_task(_collect(s, [2], 200, "long"))
        await held
        drained = asyncio.create_task(s.drain(0.3))
        await settled()
        runner.gate.set()
        counts = await asyncio.wait_for(drained, 60)
        assert counts == {"finished": 1, "migrated": 1, "kv_moved": 1}
        assert 0.3 <= s.clock.now() < 0.35
        assert (await short)[-1].finish_reason.value == "length"
        long_outs = await long
        assert long_outs[-1].finish_reason.value == "migrate" and 25 <= len(long_outs) <= 35
        with pytest.raises(DrainingError, match="draining"):
            await s.submit([1], {"max_tokens": 2}, "late", None, lambda out: None)

    asyncio.run(main())


def test_resumed_request_continues_exactly_after_the_delivered_tokens():
    """A request resumed with the tokens another replica delivered emits exactly the rest of an
    undisturbed run: no token twice, none missing, max_tokens counting the carried ones."""

    async def main():
        s, runner = serving()
        want = runner.continuation([5, 6, 7], 12)
        outs, done = [], asyncio.Event()

        def sink(out):
            outs.append(out)
            if out.finished:
                done.set()

        await s.submit([5, 6, 7], {"max_tokens": 12}, "r", None, sink, resume=Resume(want[:5], ""))
        await asyncio.wait_for(done.wait(), 60)
        assert [t for o in outs for t in o.new_token_ids] == want[5:]
        assert outs[-1].finish_reason.value == "length"
        with pytest.raises(InvalidRequestError, match="resume"):
            await s.submit([1], {"max_tokens": 3}, "x", None, sink, resume=Resume([1, 2, 3], ""))
        with pytest.raises(InvalidRequestError, match="resume"):
            await s.submit([1], {"max_tokens": 9}, "y", None, sink, resume=Resume([10**9], ""))
        with pytest.raises(InvalidRequestError, match="must be a Resume"):  # a tuple is not the message
            await s.submit([1], {"max_tokens": 9}, "z", None, sink, resume=([1], ""))

    asyncio.run(main())


def test_router_bounds_in_flight_and_skips_replicas_marked_down():
    """Past max_in_flight_per_replica everywhere the router refuses with OverloadedError (counted);
    a replica marked down gets nothing, and its in-flight requests are forgotten; a request moved
    off a replica releases its place there; a stale completion from that replica changes nothing."""
    clock = FakeClock()
    router = Router(["a", "b"], "least_loaded", clock=clock, max_in_flight_per_replica=2, max_in_flight=10)
    for i in range(4):
        router.route(RouteRequest(f"q{i}", 4, 4))
    with pytest.raises(OverloadedError, match="limit of 2") as err:
        router.route(RouteRequest("q4", 4, 4))
    assert err.value.retry_after > 0 and router.status()["rejected"] == 1
    on_b = [f"q{i}" for i in range(4) if router.load.owner(f"q{i}") == "b"]
    lost = router.mark_down("a", "lost: ActorDiedError")
    assert len(lost) == 2 and router.status()["down"] == {"a": "lost: ActorDiedError"}
    assert router.complete(on_b[0], replica_id="b")
    moved = router.route(RouteRequest(lost[0], 4, 4, moved_from="a"))
    assert moved.replica_id == "b" or pytest.fail("routed to a replica marked down")
    assert not router.complete(lost[0], replica_id="a")  # the lost replica's late word does not count
    router.mark_up("a")
    assert router.route(RouteRequest("q5", 4, 4)).replica_id == "a"
    router.mark_down("a", "draining")
    router.mark_down("b", "draining")
    with pytest.raises(OverloadedError, match="no replica is up"):
        router.route(RouteRequest("q6", 4, 4))
