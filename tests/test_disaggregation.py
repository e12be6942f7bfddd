"""The P/D decider (`router.pd_decider`) and the link that prices a hand-over
(`protocol.handover.KvLink`): llm-d's threshold on the uncached prompt, and the queue-aware
rule that disaggregates past it only when the delay it adds is the smaller one; the hand-over
time an experiment's table gives each split."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from experiments.experiment_report import format_summary, summarize_runs, transfer_seconds
from experiments.plan import plan_experiment
from experiments.run import run_experiment
from metrics.store import MetricsStore
from protocol.cost import LinearCostModel, StepPricing
from protocol.handover import CROSS_NODE, PREFILL_HANDOVER, SAME_NODE, KvLink
from protocol.messages import LoadReport, MigrationRecord
from protocol.registry import UnknownChoiceError
from protocol.routing import RouteRequest
from router.pd_decider import PD_DECIDERS, PdCosts, PdView, QueueAwareDecider, ThresholdDecider
from router.pd_router import PdPools, PdRouter
from tests.test_disaggregation_sim import write

BYTES_PER_TOKEN = 23_040  # the default model's K/V per token in bfloat16


def view(uncached: int, decode_running: int = 8, prefill_pending: int = 0) -> PdView:
    return PdView(uncached, uncached * BYTES_PER_TOKEN, decode_running, prefill_pending)


def test_link_prices_bytes_over_bandwidth_plus_latency():
    link = KvLink(bandwidth_bytes_per_s=1e9, latency_s=0.002)
    assert link.seconds(0) == 0.002
    assert link.seconds(500_000_000) == pytest.approx(0.502)
    assert CROSS_NODE.seconds(10**8) > SAME_NODE.seconds(10**8)


def test_threshold_rule_splits_at_the_uncached_prompt():
    decider = ThresholdDecider(threshold=256)
    assert [decider.disaggregate(view(n, decode_running=0)) for n in (0, 255, 256, 4000)] == [False, False, True, True]


def test_queue_aware_disaggregates_only_where_it_pays():
    """Past the threshold: a busy decode replica (8 decodes delayed by a colocated prefill)
    sends the request to the prefill pool; an idle one keeps it colocated (the hand-over and
    the prefill backlog then cost more than they save), as does a backlogged prefill replica or
    a link too slow for the bytes; below the threshold it never disaggregates."""
    decider = QueueAwareDecider(threshold=256, costs=PdCosts(prefill_seconds_per_token=2e-4, link=SAME_NODE))
    assert decider.disaggregate(view(2000, decode_running=8))
    assert not decider.disaggregate(view(2000, decode_running=0))
    assert not decider.disaggregate(view(2000, decode_running=8, prefill_pending=40_000))
    assert not decider.disaggregate(view(100, decode_running=64))
    slow = QueueAwareDecider(threshold=256, costs=PdCosts(link=KvLink(bandwidth_bytes_per_s=1e7, latency_s=0.01)))
    assert not slow.disaggregate(view(2000, decode_running=8))


def report(
    router: PdRouter, replica_id: str, running: int = 0, pending: int = 0, pricing: StepPricing | None = None
) -> None:
    """A load report from an 8-slot replica running `running` requests with `pending` prompt
    tokens queued, priced by `pricing` (None: it reports no pricing)."""
    router.report(
        LoadReport(
            replica_id,
            queue_depth=0,
            running=running,
            free_slots=8 - running,
            num_slots=8,
            free_kv_tokens=5120,
            time=0.0,
            prefill_tokens_pending=pending,
            pricing=pricing,
        )
    )


def test_queue_aware_prices_prefill_at_the_replicas_reported_step_costs():
    """The same request on the same loads (8 decodes on the decode replica, 4,000 prompt tokens
    queued on the prefill replica, a link on which its K/V take 4.6 s) is disaggregated where the
    replicas' load reports price a prefill token slowly (the colocated prefill stalls 9 requests
    for longer than the backlog and the hand-over take) and colocated where they price it fast;
    the decode replica's price prices the colocated prefill, the prefill replica's the
    disaggregated one, and a replica that reports no pricing is priced at PdCosts' fallback."""
    slow_link = KvLink(bandwidth_bytes_per_s=1e7, latency_s=0.01)
    pools = PdPools({"p": "prefill", "d": "decode"}, "queue_aware", 256, BYTES_PER_TOKEN, slow_link)

    def priced(c_prefill: float) -> StepPricing:
        return StepPricing(LinearCostModel(c0=0.02, c_decode=1e-3, c_prefill=c_prefill, c_ctx=0.0, c_held=0.0), 256)

    def route(decode_price: StepPricing | None, prefill_price: StepPricing | None) -> str:
        router = PdRouter(["p", "d"], pools)
        report(router, "p", pending=4000, pricing=prefill_price)
        report(router, "d", running=8, pricing=decode_price)
        return router.route(RouteRequest("q", prompt_len=2000, max_tokens=32)).replica_id

    slow, fast = priced(3.87e-3), priced(2e-5)  # the calibrated CPU model's price, and a fast machine's
    assert (route(slow, slow), route(fast, fast)) == ("p", "d")
    assert route(slow, fast) == "p" and route(fast, slow) == "d"
    # No pricing reported: the fallback's 2e-4 s a token makes the hand-over not worth its link.
    assert PdCosts().prefill_seconds_per_token == 2e-4 and route(None, None) == "d"
    decider = QueueAwareDecider(threshold=256, costs=PdCosts(link=slow_link))
    same = view(2000, decode_running=8, prefill_pending=4000)
    assert decider.disaggregate(replace(same, decode_seconds_per_token=3.87e-3, prefill_seconds_per_token=3.87e-3))
    assert not decider.disaggregate(replace(same, decode_seconds_per_token=2e-5, prefill_seconds_per_token=2e-5))


def test_queue_aware_counts_what_was_routed_to_the_decode_replica_since_its_report():
    """An idle decode replica's last report says it runs nothing, and it reports again only
    after its next step: the long prompts routed there meanwhile count as decodes a colocated
    prefill would stall, so once a few are there the next is disaggregated, not colocated too."""
    pools = PdPools({"p": "prefill", "d": "decode"}, "queue_aware", 256, BYTES_PER_TOKEN, SAME_NODE)
    router = PdRouter(["p", "d"], pools)
    report(router, "p", pending=2000)
    report(router, "d")
    chosen = [router.route(RouteRequest(f"q{i}", prompt_len=480, max_tokens=32)).replica_id for i in range(6)]
    # Colocated costs 480 tokens x (1 + k decodes), disaggregated 2000 + 480 backlogged ones.
    assert chosen == ["d"] * 5 + ["p"] and (router.colocated, router.disaggregated) == (5, 1)


def test_deciders_are_named_choices():
    assert list(PD_DECIDERS) == ["threshold", "queue_aware"]
    with pytest.raises(UnknownChoiceError, match="unknown P/D decider 'x'; choose one of threshold, queue_aware"):
        PD_DECIDERS["x"]


def test_the_report_gives_each_split_its_hand_over_time(tmp_path):
    """A simulated colocated cell and a 1:2 split on the same traffic: the table's hand-over
    column shows the split's mean link time per hand-over (its K/V over the same-node link,
    plus the link's latency) and nothing for the colocated cell; a table of colocated cells
    alone has no such column."""
    result = run_experiment(
        plan_experiment(write(tmp_path), simulate=True), simulate=True, store_path=tmp_path / "s.db", progress=False
    )
    colocated, split = summarize_runs(result)
    assert colocated.values["transfer"] == []
    (seconds,) = split.values["transfer"]
    store = MetricsStore(tmp_path / "s.db")
    assert seconds == store.run(result.runs[1][1])["config"]["handover_seconds_mean"] > SAME_NODE.latency_s
    store.close()
    assert "hand-over s" in format_summary([colocated, split]) and "hand-over s" not in format_summary([colocated])


def test_a_clusters_hand_over_time_counts_prefill_hand_overs_only(tmp_path):
    """A cluster's run with a prefill replica's hand-over and a drained replica's move with its
    K/V: the table's hand-over time is the prefill-to-decode fetch alone (a fallback computed
    again still counts: its fetch was tried)."""
    store = MetricsStore(tmp_path / "s.db")
    run_id = store.begin_run("pd", {}, "continuous", "least_loaded", 0)
    moves = [
        MigrationRecord("a", "replica-0", "replica-1", 1, PREFILL_HANDOVER, 1.0, 1000, 0.01),
        MigrationRecord(
            "b", "replica-0", "replica-2", 1, f"{PREFILL_HANDOVER}; K/V computed again: expired", 2.0, 0, 0.03
        ),
        MigrationRecord("c", "replica-1", "replica-2", 9, "replica-1: draining", 3.0, 5000, 0.5),
    ]
    store.add_migrations(run_id, [asdict(m) for m in moves])
    assert transfer_seconds(store, run_id) == pytest.approx(0.02)
    store.close()
