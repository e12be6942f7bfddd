# Over 400 lines: the plain code each fast path replaced sits beside the random run that compares
# them, so what the pin holds the fast paths to reads in one place.
"""The router's fast paths decide as the plain code they replaced: every policy's decisions (the
chosen replica, every replica's score, in-flight count and signal age, the predicted TTFT and
the believed-cached tokens) through a random run of routes, completions, load reports with step
prices and K/V events, and replicas marked down and up, are equal, float for float, to those of
the same run with the plain code patched back in: the decision's figures built from every
view, each replica's pending work scored afresh, the prefix policies' scores and placement
through their helper calls, the block indexes walked block by block and replica by replica, the
output residuals sorted per replica, and `predicted_latency`'s queue walked one step at a time.
The walk is also checked alone on random queues, its step bound and K/V budget included.
(`benchmarks/router_decisions.py` times the paths.) Pure objects on a fake clock."""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from dataclasses import replace

import pytest

from protocol.blocks import block_hashes
from protocol.clock import FakeClock
from protocol.cost import LinearCostModel, StepPricing
from protocol.errors import OverloadedError
from protocol.messages import KvEvents, LoadReport
from protocol.records import Decision
from protocol.routing import RouteRequest
from router import predicted_latency
from router import router as router_core
from router.block_index import BlockIndex, InFlightBlocks
from router.errors import RoutingError
from router.length_predictor import OutputResiduals
from router.load import LoadView
from router.policies import ROUTING_POLICIES, LeastLoaded, PrecisePrefix, PrefixAffinity
from router.predicted_latency import MAX_WALK_STEPS, TPOT_STEPS, Prediction
from router.router import Router
from router.work import WorkLedger

Row = predicted_latency._Row  # one request in the walk

# ---- the plain code, as it was before the fast paths ------------------------------------------


def plain_route(self: Router, request: RouteRequest) -> Decision:
    owner, moved_from = self.load.owner(request.request_id), request.moved_from
    if owner is not None and owner == moved_from:
        self.load.completed(request.request_id, moved_from)
    elif owner is not None:
        raise RoutingError(f"request {request.request_id!r} is already in flight on {owner!r}")
    now = self.clock.now()
    self._check_capacity()
    policy, views, index, scores = plain_choose(self, request, now)
    if not self.decision_figures and len(views) > 1:
        views, scores, index = [views[index]], [scores[index]], 0
    ages = []
    if policy.uses_load:
        ages = [v.report_age for v, s in zip(views, scores) if v.report_age is not None and not math.isinf(s)]
    decision = Decision(
        request_id=request.request_id,
        replica_id=views[index].replica_id,
        time=now,
        policy=policy.name,
        scores={v.replica_id: s for v, s in zip(views, scores)},
        signal_age=max(ages) if ages else None,
        in_flight={v.replica_id: v.in_flight for v in views},
        predicted_ttft=router_core._from_send(policy.predicted_ttft(views[index].replica_id), request.waited(now)),
        believed_cached=policy.believed_cached(request, views[index].replica_id),
    )
    self.load.dispatched(decision.replica_id, request.request_id)
    policy.dispatched(request, decision.replica_id, now)
    if len(self._decisions) == self._decisions.maxlen:
        self.decisions_dropped += 1
    self._decisions.append(decision)
    self.routed += 1
    return decision


def plain_choose(self: Router, request: RouteRequest, now: float):
    policy = self.policy
    if not policy.indexed:
        views = plain_routable_views(self.load, now)
        return policy, views, *policy.choose(request, views)
    index, looked = policy.choose_indexed(request, self.load.routable)
    views = plain_routable_views(self.load, now)
    if isinstance(policy, LeastLoaded):
        return policy, views, index, [v.load_score for v in views]
    return policy, views, index, [looked.get(i, math.inf) for i in range(len(views))]


def plain_routable_views(self: LoadView, now: float):
    ranked = [self.routable._ids[seq] for seq in self.routable._ranked]
    return [self.view(replica_id, now) for replica_id in ranked]


def plain_work_score(self: WorkLedger, view) -> float:
    left = self.decode_left(view)
    return self.prefill_pending(view) + self.decode_weight * (sum(left) + self.slot_wait(view, left))


def plain_work_scores(self: WorkLedger, views) -> list[float]:
    return [plain_work_score(self, v) for v in views]


def plain_prefix_scores(self: PrefixAffinity, request: RouteRequest, views) -> list[float]:
    pending = [self.work.score(v) for v in views]
    self.matched(request, views)
    bound = self.balance_ratio * min(pending) + self.balance_tokens
    return [
        p + self.miss_weight * self.prefill_tokens(request, v.replica_id) if p <= bound else math.inf
        for v, p in zip(views, pending)
    ]


def plain_precise_choose(self: PrecisePrefix, request: RouteRequest, views):
    scores = self.scores(request, views)
    best = min(range(len(scores)), key=scores.__getitem__)
    depth = self.matched_blocks(request, views[best].replica_id)
    near = [
        i
        for i, s in enumerate(scores)
        if s <= scores[best] + self.placement_slack and self.matched_blocks(request, views[i].replica_id) == depth
    ]
    held = {
        i: self.index.num_blocks(views[i].replica_id) + self.in_flight.num_blocks(views[i].replica_id) for i in near
    }
    fewest = min(held.values())
    return self.rng.choice([i for i in near if held[i] == fewest]), scores


def plain_block_matched(self: BlockIndex, hashes, replica_ids) -> dict[str, int]:
    matched = dict.fromkeys(replica_ids, 0)
    alive = 0
    for replica_id in replica_ids:
        bit = self._bit.get(replica_id)
        if bit is not None:
            alive |= 1 << bit
    for i, h in enumerate(hashes):
        if not alive:
            return matched
        holding = alive & self._holders.get(h, 0)
        for replica_id in self._replicas(alive & ~holding):
            matched[replica_id] = i
        alive = holding
    for replica_id in self._replicas(alive):
        matched[replica_id] = len(hashes)
    return matched


def plain_in_flight_matched(self: InFlightBlocks, hashes) -> dict[str, int]:
    if not hashes:
        return {}
    matched = {}
    for replica_id in self._holders.get(hashes[0], ()):
        n = 1
        while n < len(hashes) and replica_id in self._holders.get(hashes[n], ()):
            n += 1
        matched[replica_id] = n
    return matched


def plain_remaining(self: OutputResiduals, rows: list[tuple[float, int]]) -> list[float]:
    if not self._lengths:
        return [expected - made if made < expected else float(max(1, made)) for expected, made in rows]
    ordered = sorted(self._lengths)
    ahead = [[n - made for n in ordered[bisect.bisect_right(ordered, made) :]] for _, made in rows]
    rank = sorted(range(len(rows)), key=lambda i: ahead[i][len(ahead[i]) // 2] if ahead[i] else math.inf)
    out = [0.0] * len(rows)
    for j, i in enumerate(rank):
        longer = ahead[i]
        out[i] = float(longer[int((j + 0.5) / len(rows) * len(longer))]) if longer else float(max(1, rows[i][1]))
    return out


def plain_admitted(queue, slots, kv_tokens):
    if not kv_tokens:
        return queue[:slots]
    running = []
    own = shared = 0.0
    for row in queue[:slots]:
        need_own, need_shared = own + row.kv_need(), max(shared, row.shared)
        if running and need_own + need_shared > kv_tokens:
            break
        running.append(row)
        own, shared = need_own, need_shared
    return running


def plain_walk(pricing, slots, kv_tokens, rows, new) -> Prediction:
    """`predicted_latency._walk` one step at a time."""
    cost, budget = pricing.cost, pricing.token_budget
    age = new.ready
    coming = deque([*(replace(r) for r in rows), new])
    full = new not in plain_admitted(list(coming), slots, kv_tokens)
    queue = []
    elapsed, first_token, decoded = 0.0, None, 0
    joined = slotted = None
    for _ in range(MAX_WALK_STEPS):
        if not queue:
            elapsed = max(elapsed, coming[0].ready)
        while coming and coming[0].ready <= elapsed:
            queue.append(coming.popleft())
            if queue[-1] is new:
                joined = elapsed
        running = plain_admitted(queue, slots, kv_tokens)
        if slotted is None and new in running:
            slotted = elapsed
        decodes = [r for r in running if r.prefill_left <= 0]
        left = math.inf if budget is None else float(budget - len(decodes))
        context = sum(r.context + 1 for r in decodes)
        chunks = []
        for row in running:
            if row.prefill_left > 0 and left > 0:
                n = min(row.prefill_left, left)
                context += n * row.context + n * (n + 1) / 2
                left -= n
                chunks.append((row, n))
        prefill = sum(n for _, n in chunks)
        step = cost.c0 + cost.c_decode * len(decodes) + cost.c_prefill * prefill + cost.c_ctx * context
        elapsed += step
        for row in decodes:
            row.context += 1
            row.decode_left -= 1
        for row, n in chunks:
            row.prefill_left -= n
            row.context += n
            if row.prefill_left <= 0:
                row.decode_left -= 1
        if new.prefill_left <= 0 and new in queue:
            if first_token is None:
                first_token = elapsed
            else:
                decoded += 1
            if decoded >= TPOT_STEPS or new.decode_left <= 0:
                break
        elapsed += pricing.loop_overhead
        queue = [r for r in queue if r.decode_left > 0]
    if joined is None:
        return Prediction(elapsed, math.inf)
    wait = (elapsed if slotted is None else slotted) - (age if full else joined)
    if first_token is None:
        return Prediction(elapsed, math.inf, wait)
    tpot = (elapsed - first_token) / decoded if decoded else 0.0
    return Prediction(first_token - age, tpot, wait)


def patch_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Router, "route", plain_route)
    monkeypatch.setattr(WorkLedger, "score", plain_work_score)
    monkeypatch.setattr(WorkLedger, "scores", plain_work_scores)
    monkeypatch.setattr(PrefixAffinity, "scores", plain_prefix_scores)
    monkeypatch.setattr(PrecisePrefix, "choose", plain_precise_choose)
    monkeypatch.setattr(BlockIndex, "matched_blocks", plain_block_matched)
    monkeypatch.setattr(InFlightBlocks, "matched_blocks", plain_in_flight_matched)
    monkeypatch.setattr(OutputResiduals, "remaining", plain_remaining)
    monkeypatch.setattr(predicted_latency, "_walk", plain_walk)


# ---- one random run ---------------------------------------------------------------------------

BLOCK = 16
PRICINGS = (
    StepPricing(LinearCostModel(c0=0.01, c_decode=0.001, c_prefill=0.0002, c_ctx=1e-6, c_held=0.0), 64, 0.001),
    StepPricing(LinearCostModel(c0=0.02, c_decode=0.002, c_prefill=0.0004, c_ctx=0.0, c_held=0.0), None),
    None,  # a replica that states no prices
)


def run(policy: str, seed: int, replicas: int = 6, events: int = 700) -> list:
    """What the router answered to each event of a random run (decisions in full)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(BLOCK * 4)] for _ in range(3)]
    clock = FakeClock()
    ids = [f"r{i}" for i in range(replicas)]
    router = Router(ids, policy, clock, seed=seed, max_in_flight_per_replica=10)
    held: dict[str, dict[str, list]] = {r: {} for r in ids}  # replica -> request -> [prompt hashes, made]
    cached: dict[str, set[int]] = {r: set() for r in ids}
    seq = dict.fromkeys(ids, 0)
    pricing = {r: PRICINGS[i % len(PRICINGS)] for i, r in enumerate(ids)}
    out: list = []
    for step in range(events):
        clock.sleep(rng.random() * 0.02)
        now = clock.now()
        event = rng.random()
        if event < 0.45:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 90))]
            session = f"s{rng.randrange(5)}" if rng.random() < 0.5 else None
            request = RouteRequest(f"q{step}", len(tokens), 64, session, tuple(block_hashes(tokens, BLOCK)), BLOCK)
            try:
                decision = router.route(replace(request, sent_at=now - rng.random() * 0.01))
            except OverloadedError as err:
                out.append(str(err))
                continue
            out.append(decision)
            held[decision.replica_id][request.request_id] = [request.block_hashes[: (len(tokens) - 1) // BLOCK], 0]
        elif event < 0.7:
            in_flight = [(r, q) for r in ids for q in held[r]]
            if in_flight:
                replica_id, request_id = rng.choice(in_flight)
                del held[replica_id][request_id]
                out.append(router.complete(request_id, replica_id, rng.choice([None, rng.randint(1, 120)])))
        elif event < 0.95:
            replica_id = rng.choice(ids)
            requests = list(held[replica_id].items())
            tokens_made, ttft, stored = {}, {}, []
            for i, (request_id, entry) in enumerate(requests):
                if i < 4:
                    entry[1] += rng.randint(0, 6)
                    stored += [h for h in entry[0] if h not in cached[replica_id]]
                    cached[replica_id].update(entry[0])
                    if entry[1]:
                        ttft[request_id] = rng.random() * 0.3
                tokens_made[request_id] = entry[1]
            removed = [h for h in sorted(cached[replica_id]) if h not in stored and rng.random() < 0.05]
            cached[replica_id].difference_update(removed)
            events_ = KvEvents(seq[replica_id], stored=stored, removed=removed, reset=seq[replica_id] == 0)
            seq[replica_id] += 1
            running = min(4, len(requests))
            report = LoadReport(
                replica_id,
                queue_depth=len(requests) - running,
                running=running,
                free_slots=4 - running,
                num_slots=4,
                free_kv_tokens=1024,
                time=now - rng.random() * 0.03,
                prefill_tokens_pending=rng.randint(0, 300),
                tokens_made=tokens_made,
                kv_events=events_,
                ttft=ttft,
                pricing=pricing[replica_id],
                kv_capacity_tokens=rng.choice([0, 600, 4096]),
            )
            out.append(router.report(report))
        else:
            replica_id = rng.choice(ids)
            if replica_id in router.down:
                out.append(router.mark_up(replica_id))
            else:
                lost = router.mark_down(replica_id, "lost")
                for request_id in lost:
                    del held[replica_id][request_id]
                out.append(lost)
    out.append(router.status())
    return out


@pytest.mark.parametrize("policy", sorted(ROUTING_POLICIES))
def test_every_policy_decides_as_the_plain_code(policy, monkeypatch):
    fast = run(policy, seed=7)
    assert sum(isinstance(o, Decision) for o in fast) > 200
    with monkeypatch.context() as m:
        patch_plain(m)
        plain = run(policy, seed=7)
    assert len(fast) == len(plain)
    for i, (a, b) in enumerate(zip(fast, plain)):
        assert a == b, (i, a, b)


def test_predicted_latency_decides_as_the_plain_code_on_more_replicas(monkeypatch):
    fast = run("predicted_latency", seed=3, replicas=24, events=900)
    with monkeypatch.context() as m:
        patch_plain(m)
        plain = run("predicted_latency", seed=3, replicas=24, events=900)
    assert fast == plain


def random_queue(rng: random.Random):
    rows, ready = [], 0.0
    long_ones = rng.random() < 0.01  # outputs past the walk's step bound
    for _ in range(rng.randint(0, 12)):
        shared = rng.choice([0, 0, 16, 64, 200])
        if rng.random() < 0.5:
            made = rng.randint(1, 100)
            left = rng.choice([float(rng.randint(1, 80)), rng.randint(1, 80) + 0.5, rng.uniform(0.1, 60)])
            rows.append(Row(0.0, rng.randint(10, 500) + made, 5000.0 if long_ones else left, shared))
        else:
            ready += rng.choice([0.0, rng.uniform(0, 0.05)])
            expected = max(1.0, rng.choice([64.0, rng.uniform(1, 100), 97 / 3]))
            rows.append(Row(rng.randint(1, 700), shared, expected, shared, ready))
    cached = rng.choice([0, 16, 64, 300])
    expected = max(1.0, rng.choice([1.0, 8.0, 64.0, rng.uniform(1, 200)]))
    new = Row(rng.randint(1, 600), cached, expected, cached, ready + rng.choice([0.0, rng.uniform(0, 0.1)]))
    cost = LinearCostModel(
        c0=rng.uniform(0.001, 0.03),
        c_decode=rng.uniform(0, 0.002),
        c_prefill=rng.uniform(0, 0.0005),
        c_ctx=rng.choice([0.0, rng.uniform(0, 1e-5)]),
        c_held=0.0,
    )
    pricing = StepPricing(cost, rng.choice([None, 32, 256, 512]), rng.choice([0.0, rng.uniform(0, 0.003)]))
    slots = 1 if long_ones else rng.randint(1, 8)
    return pricing, slots, rng.choice([0, 0, rng.randint(200, 6000)]), rows, new


def test_the_walk_is_the_step_by_step_walk():
    """On random queues (decoding and queued rows, arrivals after the report, fractional
    outputs, token budgets or none, K/V budgets or none, a step bound reached), the walk's
    prediction is the step-by-step walk's, float for float."""
    rng = random.Random(0)
    for _ in range(1500):
        pricing, slots, kv_tokens, rows, new = random_queue(rng)
        fast = predicted_latency._walk(pricing, slots, kv_tokens, [replace(r) for r in rows], replace(new))
        assert fast == plain_walk(pricing, slots, kv_tokens, [replace(r) for r in rows], replace(new))


def test_the_residuals_are_the_per_row_residuals():
    rng = random.Random(1)
    residuals = OutputResiduals(window=64)
    for _ in range(300):
        residuals.observe(rng.randint(1, 300))
        rows = [(rng.uniform(1, 200), rng.randint(0, 320)) for _ in range(rng.randint(0, 10))]
        assert residuals.remaining(rows) == plain_remaining(residuals, rows)


def test_the_decision_benchmark_runs():
    """`benchmarks/router_decisions.py`'s steady state, small: every call it times is timed."""
    from benchmarks.router_decisions import steady_state

    figures = steady_state("precise_prefix", replicas=4, decisions=60, window_cap=2048)
    assert figures["route"]["n"] == figures["complete"]["n"] == 60
    assert figures["report"]["n"] > 0 and 0 < figures["route"]["p50"] <= figures["route"]["p99"]
