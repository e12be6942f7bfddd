# Over 400 lines: each policy needs its own realistic steady state (reports, K/V events, prices) to time.
"""How long one routing decision takes, per policy, at 4, 64 and 256 replicas, against a target
of 1 ms at p99 (and 2,000 decisions/s).

(a) The pure `Router` on a virtual clock, in a steady state like the router actor's: a window of
    requests in flight (8 per replica, at most 2,048), the oldest completing as each new one is
    routed once the window is full; a load report from each replica once per 50 decisions
    (replicas report at most every 20 ms while busy), with what a busy paged replica puts on
    one: running and queued requests, tokens made and first-token waits per request, pending
    prefill, its step pricing and K/V budget, and K/V events storing the blocks of the prompts
    it admitted (evicting its least recently used past its cache's size); prompts of a shared
    prefix out of 16 and a suffix of their own, with their chained block hashes
    (`protocol.blocks`), so the prefix-aware policies look real blocks up; and the decision log
    drained every 100 decisions, as the actor does. Each `Router.route` call is timed alone
    (time.perf_counter around it), as are `Router.complete` and `Router.report` (per request and
    per report, what they cost the actor). Decisions keep every replica's figures (the actor's
    `decision_figures=True`).
(b) With `--actor`: the `RouterActor` on a local Ray instance, with dummy replicas and a store
    that discards decisions: batches of `route.remote` calls in flight at once, then their
    completions; one call at a time (latency); and `route_many` bursts. The driver shares the
    same cores, so (b) measures the whole round trip, not the router alone; the same calls on
    actors that do nothing (synchronous and async) are measured alongside as the ceiling Ray
    allows here.

    .venv/bin/python benchmarks/router_decisions.py [--replicas 4 64 256] [--decisions 2000]
        [--policies round_robin least_loaded ...] [--actor]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from protocol.blocks import block_hashes
from protocol.clock import FakeClock
from protocol.cost import LinearCostModel, StepPricing
from protocol.cpu import cpu_info
from protocol.messages import KvEvents
from router import ROUTING_POLICIES, LoadReport, Router, RouteRequest

TARGET_P99 = 1e-3  # seconds per decision at p99, at every replica count
TARGET_RATE = 2000.0  # decisions per second
KEY_POLICIES = ("round_robin", "least_loaded", "precise_prefix", "predicted_latency")
REPLICAS = (4, 64, 256)
BURSTS = (1, 4, 16, 64)  # arrivals per route_many call

SLOTS = 8
MAX_SEQ_LEN = 640
BLOCK = 16
CACHE_BLOCKS = 2048  # blocks a replica's prefix cache holds
PREFIXES, PREFIX_BLOCKS = 16, 24  # shared prefixes of 384 tokens
PROMPTS = 1024  # distinct prompts (a shared prefix and a suffix of 16-200 tokens)
LIFETIME = 2.5  # virtual seconds a request is in flight (about 100 tokens at 25 ms per token)
REPORT_EVERY = 50  # decisions between two reports of one replica
DRAIN_EVERY = 100  # decisions between two drains of the decision log
REPORT_LAG = 0.005  # seconds a report takes to reach the router
PRICING = StepPricing(
    LinearCostModel(c0=0.012, c_decode=0.0008, c_prefill=0.00004, c_ctx=2.0e-7, c_held=0.0),
    token_budget=256,
    loop_overhead=0.001,
)


@dataclass
class _Held:
    """A request on a fake replica."""

    prompt_len: int
    hashes: tuple[int, ...]
    output_len: int
    dispatched: float
    admitted: float | None = None


class FakeReplica:
    """What the router is told by one busy paged replica: its requests in dispatch order, the
    first `SLOTS` running, and a least-recently-used prefix cache whose changes go out as
    numbered K/V event batches (the first a snapshot)."""

    def __init__(self, replica_id: str):
        self.replica_id = replica_id
        self.held: OrderedDict[str, _Held] = OrderedDict()
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.stored: dict[int, None] = {}
        self.removed: dict[int, None] = {}
        self.seq = 0

    def _store(self, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
                continue
            self.cache[h] = None
            self.removed.pop(h, None)
            self.stored[h] = None
            if len(self.cache) > CACHE_BLOCKS:
                old, _ = self.cache.popitem(last=False)
                if self.stored.pop(old, 0) is None:
                    continue  # stored and evicted within one batch: neither is sent
                self.removed[old] = None

    def report(self, now: float) -> LoadReport:
        taken = now - REPORT_LAG
        tokens_made, ttft, pending = {}, {}, 0
        for i, (request_id, r) in enumerate(self.held.items()):
            if i >= SLOTS:
                tokens_made[request_id] = 0
                pending += r.prompt_len
                continue
            if r.admitted is None:
                r.admitted = max(r.dispatched, taken - 0.01)
                self._store(r.hashes)
            made = min(r.output_len - 1, int(r.output_len * (taken - r.dispatched) / LIFETIME))
            tokens_made[request_id] = max(0, made)
            if made >= 1:
                ttft[request_id] = r.admitted - r.dispatched + 0.03
            else:
                pending += r.prompt_len // 4  # most of a prompt hits the shared prefix
        running = min(SLOTS, len(self.held))
        if self.seq == 0:
            events = KvEvents(0, stored=list(self.cache), reset=True)
        else:
            events = KvEvents(self.seq, stored=list(self.stored), removed=list(self.removed))
        self.seq += 1
        self.stored, self.removed = {}, {}
        return LoadReport(
            self.replica_id,
            queue_depth=len(self.held) - running,
            running=running,
            free_slots=SLOTS - running,
            num_slots=SLOTS,
            free_kv_tokens=max(0, SLOTS * MAX_SEQ_LEN - sum(r.prompt_len for r in list(self.held.values())[:SLOTS])),
            time=taken,
            prefill_tokens_pending=pending,
            decode_tokens_made=sum(tokens_made.values()),
            tokens_made=tokens_made,
            kv_events=events,
            ttft=ttft,
            pricing=PRICING,
            kv_capacity_tokens=SLOTS * MAX_SEQ_LEN,
        )


def make_prompts(rng: random.Random) -> list[tuple[int, tuple[int, ...]]]:
    """(prompt length, block hashes) of `PROMPTS` prompts, each a shared prefix and its own suffix."""
    prefixes = [[rng.randrange(50_000) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(PREFIXES)]
    prompts = []
    for _ in range(PROMPTS):
        tokens = rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(rng.randint(16, 200))]
        prompts.append((len(tokens), tuple(block_hashes(tokens, BLOCK))))
    return prompts


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(times: list[float], cpu: list[float] | None = None) -> dict[str, float]:
    """Percentiles of wall times (and of the thread's CPU times, where given: on a shared
    machine a call the scheduler preempted takes longer on the wall, not on the CPU)."""
    ordered = sorted(times)
    out = {
        "p50": percentile(ordered, 0.5),
        "p99": percentile(ordered, 0.99),
        "max": ordered[-1],
        "rate": len(times) / sum(times),
        "n": len(times),
    }
    if cpu:
        out["cpu_p99"] = percentile(sorted(cpu), 0.99)
    return out


def steady_state(
    policy: str, replicas: int, decisions: int, window_cap: int, warmup_windows: float = 2.0, seed: int = 0
) -> dict[str, dict]:
    """Per-call times of `route`, `complete` and `report` over `decisions` decisions once the
    window is full and `warmup_windows - 1` windows' worth of requests have completed (see the
    module docstring)."""
    rng = random.Random(seed)
    prompts = make_prompts(random.Random(1))
    ids = [f"r{i}" for i in range(replicas)]
    fleet = {rid: FakeReplica(rid) for rid in ids}
    clock = FakeClock(1000.0)
    router = Router(ids, policy=policy, clock=clock, seed=seed)
    window = min(SLOTS * replicas, window_cap)
    step = LIFETIME / window  # virtual seconds between two arrivals
    for rid in ids:
        router.report(fleet[rid].report(clock.now()))
    in_flight: deque[str] = deque()
    route_t, route_cpu, complete_t, report_t = [], [], [], []
    warmup = int(warmup_windows * window)
    report_owed, next_reporter = 0.0, 0
    perf, cpu = time.perf_counter, time.thread_time
    gc.collect()
    for i in range(warmup + decisions):
        clock.advance(step)
        now = clock.now()
        measured = i >= warmup
        if len(in_flight) >= window:
            done = in_flight.popleft()
            owner = router.load.owner(done)
            held = fleet[owner].held.pop(done)
            start = perf()
            router.complete(done, owner, held.output_len)
            if measured:
                complete_t.append(perf() - start)
        report_owed += replicas / REPORT_EVERY
        while report_owed >= 1:
            report_owed -= 1
            load = fleet[ids[next_reporter]].report(now)
            next_reporter = (next_reporter + 1) % replicas
            start = perf()
            router.report(load)
            if measured:
                report_t.append(perf() - start)
        prompt_len, hashes = prompts[rng.randrange(PROMPTS)]
        session = f"s{rng.randrange(256)}" if rng.random() < 0.5 else None
        request = RouteRequest(f"q{i}", prompt_len, 256, session, hashes, BLOCK, sent_at=now - 0.001)
        start_cpu, start = cpu(), perf()
        decision = router.route(request)
        elapsed, elapsed_cpu = perf() - start, cpu() - start_cpu
        if measured:
            route_t.append(elapsed)
            route_cpu.append(elapsed_cpu)
        cacheable = hashes[: (prompt_len - 1) // BLOCK]
        fleet[decision.replica_id].held[request.request_id] = _Held(prompt_len, cacheable, rng.randint(16, 256), now)
        in_flight.append(request.request_id)
        if i % DRAIN_EVERY == 0:
            router.drain_decisions()
    return {"route": summary(route_t, route_cpu), "complete": summary(complete_t), "report": summary(report_t)}


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def print_table(results: dict[tuple[str, int], dict[str, dict]], replicas: list[int]) -> None:
    print(
        f"{'policy':<18} {'replicas':>8} {'p50 us':>8} {'p99 us':>8} {'max us':>8} {'cpu p99':>8} {'decisions/s':>12}"
        f"  {'complete p50/p99 us':>20} {'report p50/p99 us':>18}  p99 <= 1 ms"
    )
    for (policy, n), r in results.items():
        route, complete, report = r["route"], r["complete"], r["report"]
        met = "yes" if route["p99"] <= TARGET_P99 else "NO"
        print(
            f"{policy:<18} {n:>8} {us(route['p50']):>8} {us(route['p99']):>8} {us(route['max']):>8}"
            f" {us(route['cpu_p99']):>8} {route['rate']:>12,.0f}"
            f"  {us(complete['p50']) + ' / ' + us(complete['p99']):>20}"
            f" {us(report['p50']) + ' / ' + us(report['p99']):>18}  {met}"
        )
    largest = max(replicas)
    missed = [p for (p, n), r in results.items() if n == largest and r["route"]["p99"] > TARGET_P99]
    print(f"\nat {largest} replicas, p99 over 1 ms: {', '.join(missed) if missed else 'none'}")


# ---- (b) the router actor on Ray -------------------------------------------------------------
def measure_calls(router, batch_size: int, batches: int, serial: int) -> dict[str, float]:
    """Batched route throughput, batched route+complete throughput, and the latency of one
    route call at a time (p50, p99), through any actor with `route` and `complete`."""
    import ray

    ray.get([router.route.remote(RouteRequest(f"warm{i}", 32, 64)) for i in range(200)])
    ray.get([router.complete.remote(f"warm{i}") for i in range(200)])
    route_time = total_time = 0.0
    for b in range(batches):
        ids = [f"b{b}-{i}" for i in range(batch_size)]
        start = time.perf_counter()
        ray.get([router.route.remote(RouteRequest(rid, 32, 64)) for rid in ids])
        routed = time.perf_counter()
        ray.get([router.complete.remote(rid) for rid in ids])
        route_time += routed - start
        total_time += time.perf_counter() - start
    latencies = []
    for i in range(serial):
        start = time.perf_counter()
        ray.get(router.route.remote(RouteRequest(f"one{i}", 32, 64)))
        latencies.append(time.perf_counter() - start)
        ray.get(router.complete.remote(f"one{i}"))
    latencies.sort()
    return {
        "route": batches * batch_size / route_time,
        "route+complete": batches * batch_size / total_time,
        "p50": statistics.median(latencies),
        "p99": latencies[int(0.99 * (len(latencies) - 1))],
    }


def burst_rate(router, burst: int, calls: int) -> float:
    """Decisions/s when each Ray call carries `burst` arrivals (`route_many`), as the async
    client sends the requests routed in one event-loop turn; one call in flight at a time."""
    import ray

    start = time.perf_counter()
    for c in range(calls):
        ray.get(router.route_many.remote([RouteRequest(f"m{c}-{i}", 32, 64) for i in range(burst)]))
    elapsed = time.perf_counter() - start
    ray.get([router.complete.remote(f"m{c}-{i}") for c in range(calls) for i in range(burst)])
    return calls * burst / elapsed


def actor_rates(policy: str, replicas: int, batch_size: int, batches: int, serial: int) -> dict[str, dict]:
    """The RouterActor, and as references the same calls on actors that do nothing (the most
    Ray allows here for one call per decision), synchronous and async."""
    import ray

    from router.actor import RouterActor

    @ray.remote(num_cpus=0)
    class NullReplica:
        pass

    @ray.remote(num_cpus=0)
    class NullStore:
        def add_decision_records(self, run_id, decisions) -> None:
            pass

    @ray.remote(num_cpus=0)
    class NoopRouter:
        def route(self, request) -> str:
            return "r0"

        def complete(self, request_id) -> bool:
            return True

    @ray.remote(num_cpus=0)
    class AsyncNoopRouter:
        async def route(self, request) -> str:
            return "r0"

        async def complete(self, request_id) -> bool:
            return True

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handles = {f"r{i}": NullReplica.remote() for i in range(replicas)}
        router = RouterActor.remote(handles, policy=policy, store=NullStore.remote())
        ray.get(router.set_run.remote(1))  # decisions are shipped to the store only inside a run
        results = {
            "RouterActor": measure_calls(router, batch_size, batches, serial),
            "bursts": {b: burst_rate(router, b, max(20, 2000 // b)) for b in BURSTS},
        }
        ray.get(router.flush.remote())
        status = ray.get(router.status.remote())
        if status["decisions_lost"] or any(r["in_flight"] for r in status["replicas"].values()):
            raise RuntimeError(f"the run was not clean, figures are void: {status}")
        results["no-op actor"] = measure_calls(NoopRouter.remote(), batch_size, batches, serial)
        results["no-op async actor"] = measure_calls(AsyncNoopRouter.remote(), batch_size, batches, serial)
    finally:
        ray.shutdown()
    return results


def print_actor(args: argparse.Namespace) -> dict[str, float]:
    results: dict[str, float] = {}
    print(f"\n(b) RouterActor ({args.actor_policy}, {args.actor_replicas} replicas) on local Ray,")
    print(f"    batches of {args.batch_size} calls in flight; no-op actors with the same calls as references")
    print("    (x ceiling: RouterActor / no-op actor)")
    measured = actor_rates(args.actor_policy, args.actor_replicas, args.batch_size, args.batches, args.serial)
    bursts = measured.pop("bursts")
    ceiling = measured["no-op actor"]
    print(f"{'actor':<18} {'figure':<22} {'value':>10} {'decisions/s':>12} {'x target':>9} {'x ceiling':>10}")
    for actor, figures in measured.items():
        for key in ("route", "route+complete", "p50", "p99"):
            results[f"{actor}/{key}"] = figures[key]
            latency = key in ("p50", "p99")
            rate = 1 / figures[key] if latency else figures[key]
            ceiling_rate = 1 / ceiling[key] if latency else ceiling[key]
            label = f"one at a time, {key}" if latency else f"{key} (batched)"
            value = f"{figures[key] * 1e3:.2f} ms" if latency else ""
            print(
                f"{actor:<18} {label:<22} {value:>10} {rate:>12,.0f} {rate / TARGET_RATE:>9.2f}"
                f" {rate / ceiling_rate:>10.2f}"
            )
    print("\n    RouterActor.route_many: one call carries a burst of arrivals (what the async client sends")
    print("    for requests routed in the same event-loop turn); one call in flight at a time")
    print(f"{'arrivals per call':<18} {'decisions/s':>12} {'x target':>9}")
    for burst, rate in bursts.items():
        results[f"route_many/{burst}"] = rate
        print(f"{burst:<18} {rate:>12,.0f} {rate / TARGET_RATE:>9.2f}")
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=list(REPLICAS))
    parser.add_argument("--decisions", type=int, default=2000, help="decisions timed per policy and replica count")
    parser.add_argument(
        "--policies", nargs="+", default=None, choices=sorted(ROUTING_POLICIES), help="default: every policy"
    )
    parser.add_argument("--window-cap", type=int, default=2048, help="most requests in flight (8 per replica below it)")
    parser.add_argument(
        "--warmup-windows", type=float, default=2.0, help="decisions before timing, in windows (at least 1: full)"
    )
    parser.add_argument("--actor", action="store_true", help="also measure the RouterActor on local Ray (b)")
    parser.add_argument("--actor-policy", default="least_loaded", choices=sorted(ROUTING_POLICIES))
    parser.add_argument("--actor-replicas", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=500, help="route calls in flight at once through the actor")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--serial", type=int, default=300, help="one-at-a-time calls for the latency figure")
    args = parser.parse_args(argv)
    policies = args.policies or [*KEY_POLICIES, *(p for p in ROUTING_POLICIES if p not in KEY_POLICIES)]

    print(f"CPU: {cpu_info().describe()}")
    print(
        f"target: p99 <= {TARGET_P99 * 1e3:g} ms per decision; {args.decisions:,} decisions timed per cell after "
        f"a warm-up of twice the window; in flight: {SLOTS} per replica, at most {args.window_cap:,}"
    )
    print("\n(a) pure Router.route, each call timed alone (wall; cpu: the thread's CPU time, which a")
    print("    preemption on a shared machine does not inflate); complete and report likewise, per call\n")
    results: dict[tuple[str, int], dict[str, dict]] = {}
    for policy in policies:
        for n in args.replicas:
            results[policy, n] = steady_state(policy, n, args.decisions, args.window_cap, max(1.0, args.warmup_windows))
    print_table(results, args.replicas)
    out: dict = {f"{p}/{n}": r for (p, n), r in results.items()}
    if args.actor:
        out["actor"] = print_actor(args)
    return out


if __name__ == "__main__":
    main()
