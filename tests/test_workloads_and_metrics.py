"""Standard workloads follow docs/ARCHITECTURE.md's definitions and are reproducible; the metric
definitions compute what docs/ARCHITECTURE.md says on hand-made traces."""

from __future__ import annotations

import statistics

import pytest

from metrics.definitions import SLO, RequestTrace, percentiles, summarize
from workloads import bursty_mix, long_prompts, prompt_token_ids, saturated, sigma_sweep


def test_saturated_matches_its_definition():
    """48 requests at t=0, prompts 16-64, outputs clipped to [4, 256] with median near 48."""
    w = saturated()
    assert len(w.requests) == 48 and all(r.arrival == 0 for r in w.requests)
    assert all(16 <= r.prompt_len <= 64 and 4 <= r.output_len <= 256 for r in w.requests)
    assert 30 <= statistics.median(w.output_lens) <= 70
    assert saturated() == w and saturated(seed=1) != w


def test_sigma_zero_means_equal_lengths():
    """sigma 0: every output is the median; larger sigma spreads them."""
    assert set(sigma_sweep(0.0).output_lens) == {48}
    assert statistics.pstdev(sigma_sweep(1.2).output_lens) > statistics.pstdev(sigma_sweep(0.4).output_lens)


def test_bursty_mix_is_bursty_and_mixed():
    """Hot windows get about burst_factor**2 times the arrivals of cold ones; ~70% short outputs."""
    w = bursty_mix(num_requests=2000, rate=10.0, burst_factor=3.0, period=2.0)
    arrivals = [r.arrival for r in w.requests]
    assert arrivals == sorted(arrivals)
    hot = sum(int(t // 2.0) % 2 == 0 for t in arrivals)
    assert 6 < hot / (len(arrivals) - hot) < 12
    short = sum(r.output_len <= 32 for r in w.requests) / len(w.requests)
    assert 0.65 < short < 0.75
    assert all(8 <= r.prompt_len <= 64 for r in w.requests)


def test_lengths_do_not_depend_on_rate():
    """A load sweep changes only the arrivals, never the lengths."""
    assert bursty_mix(rate=1.0).output_lens == bursty_mix(rate=9.0).output_lens


def test_long_prompts_share():
    """About 15% of long-prompts requests carry 480-token prompts."""
    w = long_prompts(num_requests=1000)
    share = sum(r.prompt_len == 480 for r in w.requests) / 1000
    assert 0.12 < share < 0.18


def test_prompt_tokens_are_deterministic_and_ordinary():
    assert prompt_token_ids(50, 3, 49152) == prompt_token_ids(50, 3, 49152) != prompt_token_ids(50, 4, 49152)
    assert all(100 <= t < 32000 for t in prompt_token_ids(500, 1, 49152))


def trace(rid, arrival, times, reason="length"):
    return RequestTrace(rid, arrival, times, times[-1] if times else arrival, reason, 4)


def test_latency_metrics_follow_the_definitions():
    """TTFT = f - a, TPOT = (c - f)/(n - 1), ITL pooled, E2E = c - a, throughput over makespan."""
    a = trace("a", 0.0, [1.0, 1.5, 2.0])
    b = trace("b", 1.0, [1.5, 3.5])
    assert (a.ttft, a.tpot, a.itls, a.e2e) == (1.0, 0.5, [0.5, 0.5], 2.0)
    s = summarize([a, b], SLO(ttft=0.75, tpot=2.0))
    assert s.makespan == 3.5 and s.throughput == pytest.approx(5 / 3.5)
    # only b meets TTFT <= 0.75
    assert s.slo_attainment == 0.5 and s.goodput == pytest.approx(2 / 3.5)
    assert s.itl["max"] == 2.0 and s.ttft["p50"] == pytest.approx(0.75)


def test_failed_requests_miss_every_slo():
    """A request that ended in error counts as missed even if it was fast."""
    s = summarize([trace("a", 0.0, [0.1, 0.2]), trace("b", 0.0, [0.1], reason="error")], SLO())
    assert s.slo_attainment == 0.5 and s.num_served == 1


def test_percentiles_of_nothing_are_none():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "max": None}
    assert percentiles([1, 2, 3, 4])["max"] == 4


def test_at_load_sets_the_mean_rate_of_a_bursty_workload():
    """at_load(load=0.8) offers 0.8 x capacity on average over hot and cold windows: the base
    rate is divided by the burst process's mean-rate factor (f + 1/f)/2."""
    from workloads.arrivals import mean_rate_factor
    from workloads.standard import at_load

    w = at_load("bursty-mix", 4000, 0.8, capacity=400.0, seed=0, period=1.0)
    mean_output = sum(w.output_lens) / len(w.output_lens)
    offered = len(w.requests) / max(r.arrival for r in w.requests) * mean_output
    assert offered == pytest.approx(0.8 * 400.0, rel=0.1)
    assert w.params["rate"] == pytest.approx(w.params["mean_rate_requests_per_s"] / mean_rate_factor(3.0))
