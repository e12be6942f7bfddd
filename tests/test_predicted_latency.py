"""The predicted_latency routing policy: its TTFT prediction, priced by each replica's own step
costs and corrected by each replica's observed error; its TPOT filter; the TTFT prediction
error reports print. Pure objects on a fake clock."""

from __future__ import annotations

import pytest

from metrics.definitions import RequestTrace
from metrics.goodput_report import ttft_prediction_error
from protocol.clock import FakeClock
from protocol.cost import LinearCostModel, StepPricing
from protocol.messages import LoadReport
from protocol.routing import RouteRequest
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model.fake import ScriptedFakeRunner
from router.errors import RoutingError
from router.load import ReplicaView
from router.policies import make_routing_policy
from router.predicted_latency import TPOT_STEPS, LatencyModel
from router.router import Router
from sim.simulator import SimulationConfig, simulate
from workloads.standard import heavy_tail_spec

STEP = LinearCostModel(c0=0.01, c_decode=0.001, c_prefill=0.0005, c_ctx=0.0, c_held=0.0)


def _report(
    replica_id: str, time: float, pricing: StepPricing, ttft: dict[str, float] | None = None, **load
) -> LoadReport:
    fields = {"queue_depth": 0, "running": 0, "free_slots": 4, "num_slots": 4, "free_kv_tokens": 4096, **load}
    return LoadReport(replica_id, time=time, pricing=pricing, ttft=ttft or {}, **fields)


def _every_slot_held(model: LatencyModel, pricing: StepPricing, made: int) -> ReplicaView:
    """Replica a with its four slots held by requests (8 tokens expected of each) that have each
    made `made` tokens, as its report at t=1 shows."""
    running = {f"q{i}": made for i in range(4)}
    for rid in running:
        model.scores(RouteRequest(rid, 10, 8), [ReplicaView("a", 0, None, None)], {}, 8.0)
        model.dispatched(RouteRequest(rid, 10, 8), "a", now=0.0, expected_output=8.0)
    return ReplicaView("a", 4, _report("a", 1.0, pricing, running=4, free_slots=0, tokens_made=running), 0.0)


def test_engine_reports_its_pricing_and_first_token_waits():
    """A fake replica's load report carries its step prices (its cost model and token budget)
    and, for each request that has made a token, how long it waited for the first: what the
    router predicts and corrects with."""
    clock = FakeClock()
    config = EngineConfig(policy="chunked", num_slots=2, max_seq_len=64, token_budget=32)
    engine = Engine(config, ScriptedFakeRunner(clock, STEP), clock)
    engine.add_request(list(range(20)), {"max_tokens": 5, "ignore_eos": True}, request_id="a", arrival_time=0.0)
    engine.step()
    report = engine.load_report("r0")
    assert report.pricing == StepPricing(STEP, 32)
    assert report.ttft == {"a": pytest.approx(0.01 + 20 * 0.0005)}


def test_prediction_tracks_a_slow_replica_after_correction():
    """A replica that runs twice as slow as the prices it reports: once its reports have shown
    the first-token waits of a few requests, the corrected prediction is within 10% of twice
    the priced one, and another replica's correction is untouched."""
    model = LatencyModel()
    pricing = StepPricing(STEP, 256)
    request = RouteRequest("probe", prompt_len=100, max_tokens=8)
    idle = ReplicaView("slow", 0, _report("slow", 0.0, pricing), 0.0)
    priced = model.predict_raw(request, idle, expected_output=8).ttft
    for i in range(40):
        rid = f"q{i}"
        model.scores(RouteRequest(rid, 100, 8), [idle], {}, 8.0)
        model.dispatched(RouteRequest(rid, 100, 8), "slow", now=float(i), expected_output=8.0)
        measured = 2 * model._by_replica["slow"][rid].predicted_ttft
        model.reported(_report("slow", i + 0.5, pricing, ttft={rid: measured}, running=1))
        model.completed(rid)
    corrected = model.corrected("slow", model.predict_raw(request, idle, expected_output=8)).ttft
    assert corrected == pytest.approx(2 * priced, rel=0.1)
    assert model.correction("fast") == 1.0


def test_tpot_correction_learns_the_decode_a_replica_reports():
    """A replica whose requests decode 1.5x slower than the walk prices them (prompts routed
    there later lengthen its steps): once its reports have shown the decode of a few requests
    over TPOT_STEPS tokens, its corrected TPOT is within 10% of 1.5x the priced one while its
    TTFT correction, learned from first tokens that came as priced, stays 1, and a TPOT limit
    the priced TPOT meets but the learned one does not scores it out."""
    model = LatencyModel()
    pricing = StepPricing(STEP, 256)
    idle = ReplicaView("a", 0, _report("a", 0.0, pricing), 0.0)
    probe = RouteRequest("probe", prompt_len=100, max_tokens=64)
    priced = model.predict_raw(probe, idle, expected_output=64.0)
    for i in range(40):
        rid, t = f"q{i}", float(i)
        model.scores(RouteRequest(rid, 100, 64), [idle], {}, 64.0)
        model.dispatched(RouteRequest(rid, 100, 64), "a", now=t, expected_output=64.0)
        placed = model._by_replica["a"][rid]
        first = t + placed.predicted_ttft
        model.reported(_report("a", first, pricing, ttft={rid: placed.predicted_ttft}, tokens_made={rid: 1}, running=1))
        made = 1 + TPOT_STEPS
        later = first + 1.5 * placed.predicted_tpot * TPOT_STEPS
        model.reported(_report("a", later, pricing, tokens_made={rid: made}, running=1))
        model.completed(rid)
    assert model.correction("a") == pytest.approx(1.0)
    assert model.tpot_correction("a") == pytest.approx(1.5, rel=0.1)
    corrected = model.corrected("a", priced)
    assert corrected.tpot == pytest.approx(1.5 * priced.tpot, rel=0.1)
    limit = 1.25 * priced.tpot
    assert LatencyModel(limit).scores(probe, [idle], {}, 64.0) == [pytest.approx(priced.ttft)]
    model.tpot_slo = limit
    other = ReplicaView("b", 0, _report("b", 0.0, StepPricing(STEP.scaled(1.1), 256)), 0.0)
    scores = model.scores(probe, [idle, other], {}, 64.0)
    assert scores[0] == float("inf") and scores[1] < float("inf")


def test_prediction_prices_the_queue_and_the_replica_speed():
    """A prompt on an idle replica costs one step of its prefill, twice as long where steps cost
    twice as much; prompts queued ahead add their prefill, chunked by the token budget."""
    model = LatencyModel()
    request = RouteRequest("new", prompt_len=200, max_tokens=8)
    fast, slow = StepPricing(STEP, 256), StepPricing(STEP.scaled(2.0), 256)
    idle_fast = ReplicaView("a", 0, _report("a", 0.0, fast), 0.0)
    idle_slow = ReplicaView("b", 0, _report("b", 0.0, slow), 0.0)
    alone = model.predict_raw(request, idle_fast).ttft
    assert alone == pytest.approx(0.01 + 200 * 0.0005)  # one step: c0 and the prompt's prefill
    assert model.predict_raw(request, idle_slow).ttft == pytest.approx(2 * alone)
    for i in range(3):  # three 200-token prompts dispatched after the report: ahead of the new one
        model.scores(RouteRequest(f"q{i}", 200, 8), [idle_fast], {}, 8.0)
        model.dispatched(RouteRequest(f"q{i}", 200, 8), "a", now=0.1, expected_output=8.0)
    busy = ReplicaView("a", 3, _report("a", 0.0, fast), 0.1)  # now: as they were sent
    # four steps of 256 tokens: 800 prompt tokens, and the decode rows of the prompts done
    # before (1 + 2 + 3), which take their share of the budget first
    assert model.predict_raw(request, busy).ttft == pytest.approx(4 * 0.01 + 800 * 0.0005 + 6 * 0.001)


def test_the_loop_work_a_replica_states_is_paid_between_the_steps_ahead():
    """A replica whose reports state the serving loop's own time between steps (a fake one's
    prices leave it out) has it added after every step the walk runs before the new prompt's
    first token, and not after that step: three prompts ahead, four steps, three gaps."""
    model = LatencyModel()
    request = RouteRequest("new", prompt_len=200, max_tokens=8)
    gap = 0.004
    for i in range(3):
        model.dispatched(RouteRequest(f"q{i}", 200, 8), "a", now=0.1, expected_output=8.0)
    plain = ReplicaView("a", 3, _report("a", 0.0, StepPricing(STEP, 256)), 0.0)
    looped = ReplicaView("a", 3, _report("a", 0.0, StepPricing(STEP, 256, loop_overhead=gap)), 0.0)
    assert model.predict_raw(request, looped).ttft == pytest.approx(model.predict_raw(request, plain).ttft + 3 * gap)
    idle = ReplicaView("b", 0, _report("b", 0.0, StepPricing(STEP, 256, loop_overhead=gap)), 0.0)
    assert model.predict_raw(request, idle).ttft == pytest.approx(0.01 + 200 * 0.0005)


def test_rows_past_their_estimate_keep_their_slots_by_the_lengths_seen():
    """Every slot of a replica holds a request that has already made more than the 8 tokens
    expected of it, and the finished outputs seen so far ran to 40 tokens: the new prompt is
    predicted to wait until the residuals of those (32 more decode steps) free a slot, not to
    take one on the next step; with no longer output seen, as long again as each has run."""
    pricing = StepPricing(STEP, 256)
    request = RouteRequest("new", prompt_len=50, max_tokens=8)
    waits = []
    for seen in (40, 8):
        model = LatencyModel()
        for i in range(8):
            model.completed(f"done{i}", output_len=seen)
        full = _every_slot_held(model, pricing, made=8)
        waits.append(model.predict_raw(request, full, expected_output=8.0).ttft)
    step = 0.01 + 4 * 0.001  # four decode rows
    assert waits[0] == pytest.approx(32 * step + 0.01 + 50 * 0.0005)
    assert waits[1] == pytest.approx(8 * step + 0.01 + 50 * 0.0005)


def test_rows_holding_every_slot_spread_as_the_lengths_seen():
    """Four rows have each made one token and the finished outputs ran 2 to 64 tokens: the rows
    are given the 1/8, 3/8, 5/8 and 7/8 quantiles of what those still had to go, so the first
    slot is predicted to free after 8 more steps (the shortest of four), not after the median
    32 of any one; the new prompt's prediction counts that wait as a wait for a slot."""
    pricing = StepPricing(STEP, 256)
    model = LatencyModel()
    for n in range(2, 65):
        model.completed(f"done{n}", output_len=n)
    assert model.residuals.remaining([(8.0, 1)] * 4) == [8.0, 24.0, 40.0, 56.0]
    full = _every_slot_held(model, pricing, made=1)
    predicted = model.predict_raw(RouteRequest("new", prompt_len=50, max_tokens=8), full, expected_output=8.0)
    step = 0.01 + 4 * 0.001  # four decode rows
    assert predicted.slot_wait == pytest.approx(8 * step)
    # then its prefill, beside the three rows still decoding
    assert predicted.ttft == pytest.approx(8 * step + 0.01 + 3 * 0.001 + 50 * 0.0005)


def test_slot_waits_are_corrected_apart_from_the_replicas_speed():
    """On a replica priced right, requests that found every slot held waited twice the slot wait
    predicted for them: the wait correction learns 2 while the replica's own correction stays 1,
    so the next full-replica prediction doubles its wait and not its prefill."""
    pricing = StepPricing(STEP, 256)
    model = LatencyModel()
    for n in range(2, 65):
        model.completed(f"done{n}", output_len=n)
    full = _every_slot_held(model, pricing, made=1)
    for i in range(40):
        rid = f"w{i}"
        model.scores(RouteRequest(rid, 50, 8), [full], {}, 8.0)
        model.dispatched(RouteRequest(rid, 50, 8), "a", now=0.5, expected_output=8.0)
        placed = model._by_replica["a"][rid]
        measured = placed.predicted_ttft + placed.predicted_wait  # its wait twice as long
        model.reported(_report("a", 2.0, pricing, ttft={rid: measured}, running=4, free_slots=0))
        model.completed(rid)
    assert model.wait_correction() == pytest.approx(2.0, rel=0.05)
    assert model.correction("a") == 1.0
    raw = model.predict_raw(RouteRequest("new", prompt_len=50, max_tokens=8), full, expected_output=8.0)
    corrected = model.corrected("a", raw)
    assert corrected.ttft == pytest.approx(raw.ttft - raw.slot_wait + raw.slot_wait * model.wait_correction())


def test_tpot_filter_prefers_the_replica_that_meets_the_slo():
    """Replica a would give the first token soonest but decodes too slowly for the TPOT SLO,
    so the request goes to b; when no replica meets the SLO, the soonest first token wins."""
    quick_start = StepPricing(LinearCostModel(c0=0.01, c_decode=0.1, c_prefill=0.0, c_ctx=0.0, c_held=0.0), 256)
    quick_decode = StepPricing(LinearCostModel(c0=0.01, c_decode=0.0, c_prefill=0.001, c_ctx=0.0, c_held=0.0), 256)
    views = [
        ReplicaView("a", 0, _report("a", 0.0, quick_start), 0.0),
        ReplicaView("b", 0, _report("b", 0.0, quick_decode), 0.0),
    ]
    request = RouteRequest("x", prompt_len=100, max_tokens=16)
    for tpot_slo, chosen in ((0.05, "b"), (0.001, "a")):
        scores = LatencyModel(tpot_slo).scores(request, views, {}, 16.0)
        assert views[min(range(2), key=scores.__getitem__)].replica_id == chosen


def test_the_runs_tpot_slo_reaches_the_policy_through_the_router():
    """Replica a gives the first token soonest but decodes at about 0.11 s per token, b at about
    0.01: a router made with a tight TPOT limit (0.05 s) sends the request to b, one with a loose
    limit (1 s) to a, and `set_policy` carries a new limit to the fresh policy (or keeps the one
    it had); a limit that is not a positive number is refused."""
    quick_start = StepPricing(LinearCostModel(c0=0.01, c_decode=0.1, c_prefill=0.0, c_ctx=0.0, c_held=0.0), 256)
    quick_decode = StepPricing(LinearCostModel(c0=0.01, c_decode=0.0, c_prefill=0.001, c_ctx=0.0, c_held=0.0), 256)

    def router(tpot_slo: float | None) -> Router:
        made = Router(["a", "b"], "least_loaded", FakeClock())
        made.set_policy("predicted_latency", tpot_slo)
        made.report(_report("a", 0.0, quick_start))
        made.report(_report("b", 0.0, quick_decode))
        return made

    for tpot_slo, chosen in ((0.05, "b"), (1.0, "a")):
        made = Router(["a", "b"], "predicted_latency", FakeClock(), tpot_slo=tpot_slo)
        made.report(_report("a", 0.0, quick_start))
        made.report(_report("b", 0.0, quick_decode))
        assert made.route(RouteRequest("x", prompt_len=100, max_tokens=16)).replica_id == chosen, tpot_slo
        assert router(tpot_slo).route(RouteRequest("x", prompt_len=100, max_tokens=16)).replica_id == chosen
    kept = Router(["a", "b"], "least_loaded", FakeClock(), tpot_slo=0.05)
    kept.set_policy("predicted_latency")
    assert kept.policy.latency.tpot_slo == 0.05 and kept.status()["tpot_slo"] == 0.05
    assert make_routing_policy("predicted_latency", tpot_slo=0.3).latency.tpot_slo == 0.3
    assert make_routing_policy("least_loaded", tpot_slo=0.3).name == "least_loaded"  # takes no SLO
    with pytest.raises(RoutingError, match="tpot_slo"):
        Router(["a"], "predicted_latency", FakeClock(), tpot_slo=0.0)
    with pytest.raises(RoutingError, match="tpot_slo"):
        kept.set_policy("predicted_latency", -1.0)


SLO_EXPERIMENT = """\
name = "tpot-limit"
description = "two fake replicas, one four times slower per step, routed by predicted_latency"

[workload]
standard = "bursty-mix"
args = {{ num_requests = 16 }}

[cluster]
replicas = 2
slots = 4
max_seq_len = 256
model = "fake"
fake_step_seconds = 0.01
cost_scales = [1.0, 4.0]

[sweep]
batching = ["continuous"]
routing = ["predicted_latency"]
load = [0.5]
seeds = [0]

[slo]
ttft = 2.0
tpot = {tpot}
"""


@pytest.mark.parametrize("tpot", [0.02, 1.0])
def test_the_experiments_slo_reaches_the_policy_in_a_simulated_run(tmp_path, tpot):
    """A simulated experiment routes within its file's `[slo] tpot`: the slow replica decodes at
    0.04 s per token, so under a 0.02 s limit every decision scores it out (+inf, stored as
    null) and the fast replica serves every request, while under a 1 s limit every decision
    scores both by their predicted TTFT; the run records the SLO it was routed within."""
    from experiments.plan import plan_experiment
    from experiments.run import run_experiment
    from metrics.store import MetricsStore

    path = tmp_path / "tpot.toml"
    path.write_text(SLO_EXPERIMENT.format(tpot=tpot))
    result = run_experiment(
        plan_experiment(path, simulate=True), simulate=True, store_path=tmp_path / "s.db", progress=False
    )
    store = MetricsStore(tmp_path / "s.db")
    [(_, run_id)] = result.runs
    assert store.run(run_id)["slo"]["tpot"] == tpot
    decisions = store.decisions(run_id)
    scored_out = [d["scores"]["r1"] is None for d in decisions]
    assert len(decisions) == 16 and all(d["scores"]["r0"] is not None for d in decisions)
    if tpot < 0.04:
        assert all(scored_out) and {t.replica for t in store.traces(run_id)} == {"r0"}
    else:
        assert not any(scored_out)


def test_router_records_the_prediction_of_the_chosen_replica():
    """A decision of predicted_latency carries the TTFT it predicted on the replica it chose;
    other policies predict none."""
    clock = FakeClock()
    router = Router(["a", "b"], "predicted_latency", clock)
    router.report(_report("a", 0.0, StepPricing(STEP, 256)))
    router.report(_report("b", 0.0, StepPricing(STEP.scaled(3.0), 256)))
    decision = router.route(RouteRequest("x", prompt_len=100, max_tokens=8))
    assert decision.replica_id == "a"
    assert decision.predicted_ttft == pytest.approx(decision.scores["a"])
    assert Router(["a"], "least_loaded", clock).route(RouteRequest("y", 10, 4)).predicted_ttft is None


def test_the_wait_before_the_router_is_added_to_the_prediction_not_learned_as_slowness():
    """A request that reached the router 30 ms after its client sent it (`sent_at`) on a replica
    that runs exactly as priced: its TTFT counts from the send, so the decision records the
    walk's TTFT plus those 30 ms, and the replica's correction, learned from TTFTs that are the
    walk's plus the wait, stays 1 (learned as a scale, the wait would make the replica look 1.5x
    slow and every queue behind it 1.5x long)."""
    clock = FakeClock()
    router = Router(["a"], "predicted_latency", clock)
    pricing = StepPricing(STEP, 256)
    for i in range(40):
        clock.advance(1.0)
        router.report(_report("a", clock.now(), pricing))
        decision = router.route(RouteRequest(f"q{i}", 100, 8, sent_at=clock.now() - 0.03))
        assert decision.predicted_ttft == pytest.approx(decision.scores["a"] + 0.03)
        router.report(_report("a", clock.now() + 0.5, pricing, ttft={f"q{i}": decision.predicted_ttft}, running=1))
        router.complete(f"q{i}", "a", output_len=8)
    assert router.policy.latency.correction("a") == pytest.approx(1.0)


def test_predicted_latency_avoids_the_slow_replica_under_load():
    """Two replicas, one four times slower: under load predicted_latency sends the slow one far
    fewer requests than least_loaded (which counts requests) and gets lower TTFT p90."""
    workload = heavy_tail_spec(num_requests=120, rate=12.0, seed=3).build()
    engine = EngineConfig(policy="chunked", num_slots=4, max_seq_len=512)
    share, p90 = {}, {}
    for policy in ("least_loaded", "predicted_latency"):
        config = SimulationConfig(num_replicas=2, engine=engine, routing_policy=policy, cost_scales=[0.125, 0.5])
        result = simulate(workload, config, STEP.scaled(2.0))
        share[policy] = sum(t.replica == "r1" for t in result.traces) / len(result.traces)
        ttfts = sorted(t.ttft for t in result.traces if t.ttft is not None)
        p90[policy] = ttfts[int(0.9 * len(ttfts))]
    assert share["predicted_latency"] < 0.3 < share["least_loaded"]
    assert p90["predicted_latency"] < p90["least_loaded"]


def test_mape_of_a_tiny_known_case():
    """MAPE over the requests with a first token and a prediction, a moved request's last one:
    |1.0 - 0.5| / 0.5 = 1.0 and |2.0 - 2.5| / 2.5 = 0.2 give 0.6 over two requests."""
    traces = [
        RequestTrace("a", 0.0, [0.5, 0.6], 0.6, "length", 10),
        RequestTrace("b", 1.0, [3.5], 3.5, "length", 10),
        RequestTrace("c", 0.0, [0.2], 0.2, "length", 10),  # decided by a policy that predicts nothing
        RequestTrace("d", 0.0, [], 0.1, "rejected", 10),
    ]
    decisions = [
        {"request_id": "a", "predicted_ttft": 1.0},
        {"request_id": "b", "predicted_ttft": 9.0},
        {"request_id": "b", "predicted_ttft": 2.0},  # moved: the last decision counts
        {"request_id": "c", "predicted_ttft": None},
        {"request_id": "d", "predicted_ttft": 0.3},
    ]
    assert ttft_prediction_error(traces, decisions) == {"mape": pytest.approx(0.6), "requests": 2}
    assert ttft_prediction_error(traces[2:], decisions)["mape"] is None


def test_policy_is_registered_under_its_name():
    assert make_routing_policy("predicted_latency").name == "predicted_latency"
