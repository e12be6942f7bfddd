"""The P/D decider (`router.pd_decider`) and the link that prices a hand-over
(`protocol.handover.KvLink`): llm-d's threshold on the uncached prompt, and the queue-aware
rule that disaggregates past it only when the delay it adds is the smaller one."""

from __future__ import annotations

import pytest

from protocol.handover import CROSS_NODE, SAME_NODE, KvLink
from protocol.registry import UnknownChoiceError
from router.pd_decider import PD_DECIDERS, PdCosts, PdView, QueueAwareDecider, ThresholdDecider

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


def test_deciders_are_named_choices():
    assert list(PD_DECIDERS) == ["threshold", "queue_aware"]
    with pytest.raises(UnknownChoiceError, match="unknown P/D decider 'x'; choose one of threshold, queue_aware"):
        PD_DECIDERS["x"]
