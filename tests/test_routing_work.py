"""Routing on work and cache, pure: prefix-structured workloads (Mooncake hash_ids, the
shared-prefix sessions), load from work, the work ledger, the length predictors, the prefix
index and the policies on the pure Router with a fake clock, and the decision audit."""

from __future__ import annotations

import json

import pytest

from metrics.audit import regrets
from metrics.definitions import RequestTrace
from protocol.blocks import block_hashes
from protocol.clock import FakeClock
from router import LoadReport, Router, RouteRequest
from router.length_predictor import BucketedLength, MeanLength
from router.prefix_index import PrefixIndex
from workloads.capacity import Capacity
from workloads.prefixes import best_prefix_hit_rate
from workloads.standard import standard_spec
from workloads.traces import MOONCAKE_SAMPLE, TraceError, read_mooncake_jsonl
from workloads.workload import request_prompt


def report(replica_id: str, t: float = 0.0, free: int = 4, running: int = 0, **work) -> LoadReport:
    return LoadReport(replica_id, 0, running, free, 4, 1024 * free, t, **work)


# --- workloads -----------------------------------------------------------------------------


def test_mooncake_hash_ids_become_shared_prompt_blocks(tmp_path):
    """Requests naming the same leading hash ids send the same leading tokens, one block per id
    of 512 x length_scale tokens; the workload is named after its file."""
    path = tmp_path / "tiny.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 9]},
        {"timestamp": 20, "input_length": 1000, "output_length": 10, "hash_ids": [7, 2]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = read_mooncake_jsonl(path, length_scale=0.1)
    assert w.name == "tiny" and w.params["block_len"] == 51
    a, b, c = (request_prompt(0, i, r, 1000) for i, r in enumerate(w.requests))
    assert (len(a), len(b), len(c)) == (150, 120, 100)
    assert a[:102] == b[:102] and a[102] != b[102]  # blocks 1 and 2 shared, then 3 against 9
    assert a[:51] != c[:51]  # a shared second id does not share a prefix after a different first
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}) + "\n")
    with pytest.raises(TraceError, match=r"tiny.jsonl:1: hash_ids must be a list of ints"):
        read_mooncake_jsonl(path)


def test_the_shipped_mooncake_sample_has_shared_prefixes():
    w = read_mooncake_jsonl(MOONCAKE_SAMPLE, length_scale=0.05)
    assert w.name == "mooncake_sample" and len(w.requests) == 240
    assert 0.3 < best_prefix_hit_rate(w, 0, 32_000, 16) < 0.9


def test_shared_prefix_sessions_extend_their_last_turn_and_share_system_prompts():
    """Each turn's prompt starts with the session's previous prompt; the most popular system
    prompt (Zipf rank 1) opens the most sessions; a cache could skip most prompt tokens."""
    w = standard_spec("shared-prefix", num_requests=300).build()
    last: dict[str, tuple[int, ...]] = {}
    extended = 0
    for r in w.requests:
        if r.session_id in last:
            assert r.blocks[: len(last[r.session_id])] == last[r.session_id]
            extended += 1
        last[r.session_id] = r.blocks
        assert r.prompt_len + r.output_len <= 480 or len(r.blocks) * 16 == r.prompt_len
    firsts = {}
    for r in w.requests:
        firsts.setdefault(r.session_id, r.blocks[0] // 1_000_000)
    counts = [list(firsts.values()).count(k) for k in range(1, 9)]
    assert extended > 100 and counts[0] == max(counts)
    assert best_prefix_hit_rate(w, 0, 1000, 16) > 0.6


def test_load_counts_prefill_and_decode_work():
    """A request's work is its prompt at the prefill rate plus its output at the decode rate;
    a decode-only capacity gives the old rate, and prefill-heavy traffic gets a far lower rate."""
    cap = Capacity(decode_tokens_per_s=100.0, prefill_tokens_per_s=1000.0)
    assert cap.work_seconds(500, 10) == pytest.approx(0.6)
    assert cap.rate_for(0.8, [(500, 10)] * 3) == pytest.approx(0.8 / 0.6)
    assert Capacity(100.0).rate_for(0.8, [(500, 10)]) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="capacity must be > 0"):
        Capacity(0.0)


# --- the router's pieces -------------------------------------------------------------------


def test_length_predictors_learn_from_finished_requests_not_max_tokens():
    mean, bucketed = MeanLength(prior=64), BucketedLength(prior=64, min_samples=2)
    short = RouteRequest("a", prompt_len=10, max_tokens=999)
    assert mean.estimate(short) == 64 == bucketed.estimate(short)
    for n in (10, 20, 30):
        mean.observe(RouteRequest("x", 10, 999), n)
        bucketed.observe(RouteRequest("x", 10, 999), n)
    bucketed.observe(RouteRequest("y", 300, 999), 200)
    assert mean.estimate(short) == 20
    assert bucketed.estimate(short) == 20  # the median of its prompt-length bucket
    assert bucketed.estimate(RouteRequest("z", 300, 999)) == 65  # one sample: the running mean
    bucketed.observe(RouteRequest("s", 10, 999, session_id="chat"), 7)
    assert bucketed.estimate(RouteRequest("t", 300, 999, session_id="chat")) == 7  # the session's last


def test_prefix_index_matches_leading_blocks_and_evicts_least_recently_used():
    index = PrefixIndex(capacity_blocks=3)
    index.insert("r0", [1, 2, 3])
    index.insert("r1", [1, 5])
    assert index.matched_blocks([1, 2, 3, 4], ["r0", "r1", "r2"]) == {"r0": 3, "r1": 1, "r2": 0}
    index.insert("r0", [7, 8])  # evicts r0's blocks 1 and 2
    assert index.matched_blocks([1, 2, 3], ["r0", "r1"]) == {"r0": 0, "r1": 1}
    assert index.num_blocks("r0") == 3


def test_least_work_reserves_at_dispatch_and_releases_as_tokens_are_made():
    """The expected output (the prior, 64) is reserved; a report of tokens made releases it,
    completion drops it; the next request goes where less work waits."""
    router = Router(["r0", "r1"], policy="least_work", clock=FakeClock())
    assert router.route(RouteRequest("a", prompt_len=100, max_tokens=64)).replica_id == "r0"
    view = router.load.views(0.0)[0]
    assert router.policy.work.pending(view) == 100 + 4 * 64
    router.report(report("r0", t=0.0, running=1, prefill_tokens_pending=0, tokens_made={"a": 60}))
    view = router.load.views(0.0)[0]
    assert router.policy.work.pending(view) == 4 * 4
    assert router.route(RouteRequest("b", prompt_len=10, max_tokens=64)).replica_id == "r1"
    router.complete("a", output_len=70)
    assert router.policy.work.pending(router.load.views(0.0)[0]) == 0
    assert router.policy.lengths.estimate(RouteRequest("c", 10, 1)) == 70


def test_least_work_counts_the_prompt_of_a_request_the_report_does_not_list_yet():
    """A report taken after a dispatch but before the request reached the replica (on its way, or
    in the inbox while a long step ran) leaves it out: its prompt is still work waiting there."""
    router = Router(["r0"], policy="least_work", clock=FakeClock())
    router.route(RouteRequest("a", prompt_len=100, max_tokens=64))
    router.report(report("r0", t=1.0, prefill_tokens_pending=30, tokens_made={"other": 0}))
    assert router.policy.work.prefill_pending(router.load.views(1.0)[0]) == 30 + 100


def test_least_work_waits_for_a_slot_by_the_work_of_the_running_requests():
    """With every slot taken, the new request waits for the first running request to end:
    the replica whose running requests are nearly done wins over an equally full one."""
    router = Router(["r0", "r1"], policy="least_work", clock=FakeClock())
    for i in range(8):
        router.route(RouteRequest(f"q{i}", prompt_len=1, max_tokens=64))
    made = {f"q{i}": 60 for i in range(0, 8, 2)}  # r0's requests (even ones) are nearly done
    router.report(LoadReport("r0", 0, 4, 0, 4, 0, 1.0, tokens_made=made))
    router.report(LoadReport("r1", 0, 4, 0, 4, 0, 1.0, tokens_made={f"q{i}": 1 for i in range(1, 8, 2)}))
    views = router.load.views(1.0)
    assert router.policy.work.slot_wait(views[0]) == 4 and router.policy.work.slot_wait(views[1]) == 63
    assert router.route(RouteRequest("new", prompt_len=1, max_tokens=64)).replica_id == "r0"


def test_prefix_affinity_follows_the_cached_prefix_until_the_guard_stops_it():
    """Score = prompt tokens not cached there + pending work. Once the first request's prompt
    is computed on r0, the next with that prefix goes there; a long cached prefix on a replica
    whose pending work is past the guard (1.5 x the least + 1024) is passed over all the same."""
    clock = FakeClock()
    router = Router(["r0", "r1", "r2"], policy="prefix_affinity", clock=clock)
    hashes = tuple(block_hashes(list(range(100, 420)), 16))  # 320 tokens: 20 blocks
    assert router.route(RouteRequest("p0", 320, 64, block_hashes=hashes)).replica_id == "r0"
    clock.sleep(1.0)
    router.report(report("r0", t=1.0, running=1, prefill_tokens_pending=0, tokens_made={"p0": 0}))
    assert router.route(RouteRequest("p1", 320, 64, block_hashes=hashes)).replica_id == "r0"  # 256 < 320
    long = tuple(block_hashes(list(range(100, 3300)), 16))  # 3,200 tokens
    router.policy.index.insert("r1", long)
    for i in range(3):  # r1 holds the long prefix but gets 3 x 1,000 prompt tokens of other work
        router.policy.work.reserve(f"w{i}", "r1", 1000, 0, 0.5)
    scores = router.policy.scores(RouteRequest("q", 3200, 64, block_hashes=long), router.load.views(1.0))
    assert scores[1] == float("inf")  # cost 3,000 < 3,200 elsewhere, but past the guard
    assert router.route(RouteRequest("q", 3200, 64, block_hashes=long)).replica_id == "r2"


def test_regret_is_ttft_lost_against_the_nearest_request_on_another_replica():
    traces = [
        RequestTrace("a", 0.0, [2.0], 3.0, "length", 10, replica="r0"),
        RequestTrace("b", 0.1, [0.3], 1.0, "length", 10, replica="r1"),
        RequestTrace("c", 5.0, [5.1], 6.0, "length", 10, replica="r0"),
    ]
    assert regrets(traces) == pytest.approx([1.8, 0.0])  # c has no neighbour on r1 within 1 s
