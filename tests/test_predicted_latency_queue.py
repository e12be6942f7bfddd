"""What predicted_latency's walk takes a replica's queue to be: the requests its reports list,
those on their way that no report lists yet, and as many as the replica's K/V admits. Pure
objects on a fake clock."""

from __future__ import annotations

import pytest

from protocol.cost import LinearCostModel, StepPricing
from protocol.messages import LoadReport
from protocol.routing import RouteRequest
from router.load import ReplicaView
from router.predicted_latency import LatencyModel

STEP = LinearCostModel(c0=0.01, c_decode=0.001, c_prefill=0.0005, c_ctx=0.0, c_held=0.0)
PRICING = StepPricing(STEP, 256)


def _report(time: float, tokens_made: dict[str, int], **load) -> LoadReport:
    fields = {"queue_depth": 0, "running": 0, "free_slots": 4, "num_slots": 4, "free_kv_tokens": 4096, **load}
    return LoadReport("a", time=time, pricing=PRICING, tokens_made=tokens_made, **fields)


def _dispatch(model: LatencyModel, request_id: str, prompt_len: int, now: float) -> None:
    model.scores(RouteRequest(request_id, prompt_len, 8), [ReplicaView("a", 0, None, None)], {}, 8.0)
    model.dispatched(RouteRequest(request_id, prompt_len, 8), "a", now=now, expected_output=8.0)


def test_a_request_no_report_has_listed_yet_is_queued_ahead_and_one_that_left_is_not():
    """A request sent before the replica's report but not in it (on its way, or in the replica's
    inbox while a long step ran) is ahead of a new one: its prompt is priced. One an earlier
    report listed and the last does not has ended (its completion is on its way): not priced."""
    model = LatencyModel()
    _dispatch(model, "early", 200, now=0.0)
    _dispatch(model, "late", 200, now=0.5)
    model.reported(_report(0.2, {"early": 0}))  # lists "early" only: "late" was not there yet
    view = ReplicaView("a", 2, _report(1.0, {"early": 3}, running=1, free_slots=3), 0.0)
    model.reported(view.report)
    new = RouteRequest("new", 100, 8)
    # one step: the decode row of "early", all of "late"'s prompt and 56 of the new one's; then the rest
    step = 0.01 + 0.001 + 256 * 0.0005
    assert model.predict_raw(new, view).ttft == pytest.approx(step + 0.01 + 2 * 0.001 + 44 * 0.0005)
    gone = ReplicaView("a", 1, _report(2.0, {"late": 3}, running=1, free_slots=3), 0.0)
    model.reported(gone.report)  # "early" listed before, absent now: it ended
    assert model.predict_raw(new, gone).ttft == pytest.approx(0.01 + 0.001 + 100 * 0.0005)


def test_a_request_sent_after_an_idle_report_has_not_run_since_that_report():
    """The report was taken with the replica idle, a second before a 200-token prompt was sent
    there: the walk starts at the report, but that prompt starts when it arrives, so a request
    sent 50 ms after it waits out its prefill step and is not taken to find the replica free."""
    model = LatencyModel()
    _dispatch(model, "a", 200, now=1.0)
    view = ReplicaView("a", 1, _report(0.0, {}), 1.05)  # now is 1.05 s after the report
    prefill_a = 0.01 + 200 * 0.0005  # from 1.0 to 1.11; the new request joins the next step
    ttft = 1.0 + prefill_a + (0.01 + 0.001 + 100 * 0.0005) - 1.05
    assert model.predict_raw(RouteRequest("new", 100, 8), view).ttft == pytest.approx(ttft)


def test_a_request_whose_kv_does_not_fit_waits_though_a_slot_is_free():
    """Two 100-token prompts decode on a 4-slot replica with room for 250 K/V tokens: a third does
    not fit, so it waits for one to end, as a paged replica admits; with no bound (0) or room, it starts."""
    predicted = {}
    for capacity in (250, 0, 400):
        model = LatencyModel()
        for rid in ("q0", "q1"):
            _dispatch(model, rid, 100, now=0.0)
        load = {"running": 2, "free_slots": 2, "kv_capacity_tokens": capacity}
        view = ReplicaView("a", 2, _report(1.0, {"q0": 1, "q1": 1}, **load), 0.0)
        predicted[capacity] = model.predict_raw(RouteRequest("new", 100, 8), view, expected_output=8.0)
    assert predicted[0] == predicted[400] and predicted[0].ttft == pytest.approx(0.01 + 2 * 0.001 + 100 * 0.0005)
    assert predicted[250].slot_wait == pytest.approx(7 * (0.01 + 2 * 0.001))  # 7 more two-row decode steps
