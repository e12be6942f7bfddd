"""How many routing decisions per second the router sustains, against a target of 2,000/s.

(a) The pure `Router`, every policy: route + complete in a loop over 8 replicas, with a window
    of requests in flight, a load report every 50 decisions and the decision log drained every
    100 (what the actor does), on the wall clock.
(b) The `RouterActor` on a local Ray instance, with 8 dummy replicas and a store that discards
    decisions: batches of `route.remote` calls in flight at once, then their completions; and
    one call at a time (latency). The driver submitting the calls shares the same cores, so
    (b) measures the whole round trip, not the router alone; the same calls on actors that do
    nothing (synchronous and async) are measured alongside as the ceiling Ray allows here.

    python benchmarks/router_throughput.py [--requests 20000] [--batch-size 500] [--batches 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from router import ROUTING_POLICIES, LoadReport, Router, RouteRequest

TARGET = 2000.0  # decisions per second
BURSTS = (1, 4, 16, 64)  # arrivals per route_many call
SLOTS = 8


def random_report(replica_id: str, rng: random.Random) -> LoadReport:
    """A plausible report: some slots busy, a short queue only when none is free."""
    free = rng.randint(0, SLOTS)
    return LoadReport(
        replica_id,
        queue_depth=rng.randint(0, 4) if free == 0 else 0,
        running=SLOTS - free,
        free_slots=free,
        num_slots=SLOTS,
        free_kv_tokens=512 * free,
        time=time.time(),
    )


def pure_rate(policy: str, replicas: int, requests: int, window: int = 64) -> float:
    """Decisions per second of `Router.route` + `Router.complete` alone."""
    rng = random.Random(0)
    ids = [f"r{i}" for i in range(replicas)]
    router = Router(ids, policy=policy)
    for replica_id in ids:
        router.report(random_report(replica_id, rng))
    sessions = [f"s{i}" for i in range(100)]
    start = time.perf_counter()
    for i in range(requests):
        router.route(RouteRequest(f"q{i}", 32, 64, sessions[i % 100]))
        if i >= window:
            router.complete(f"q{i - window}")
        if i % 50 == 0:
            router.report(random_report(ids[i % replicas], rng))
        if i % 100 == 0:
            router.drain_decisions()
    return requests / (time.perf_counter() - start)


def measure_calls(router, batch_size: int, batches: int, serial: int) -> dict[str, float]:
    """Batched route throughput, batched route+complete throughput, and the latency of one
    route call at a time (p50, p99), through any actor with `route` and `complete`."""
    import ray

    ray.get([router.route.remote(f"warm{i}", 32, 64) for i in range(200)])
    ray.get([router.complete.remote(f"warm{i}") for i in range(200)])
    route_time = total_time = 0.0
    for b in range(batches):
        ids = [f"b{b}-{i}" for i in range(batch_size)]
        start = time.perf_counter()
        ray.get([router.route.remote(rid, 32, 64) for rid in ids])
        routed = time.perf_counter()
        ray.get([router.complete.remote(rid) for rid in ids])
        route_time += routed - start
        total_time += time.perf_counter() - start
    latencies = []
    for i in range(serial):
        start = time.perf_counter()
        ray.get(router.route.remote(f"one{i}", 32, 64))
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


def actor_rates(policy: str, replicas: int, batch_size: int, batches: int, serial: int) -> dict[str, dict[str, float]]:
    """The RouterActor, and as references the same calls on actors that do nothing (the most
    Ray allows here for one call per decision), synchronous and async."""
    import ray

    from router.actor import RouterActor

    @ray.remote(num_cpus=0)
    class NullReplica:
        pass

    @ray.remote(num_cpus=0)
    class NullStore:
        def add_decisions(self, run_id, rows) -> None:
            pass

    @ray.remote(num_cpus=0)
    class NoopRouter:
        def route(self, request_id, prompt_len, max_tokens) -> str:
            return "r0"

        def complete(self, request_id) -> bool:
            return True

    @ray.remote(num_cpus=0)
    class AsyncNoopRouter:
        async def route(self, request_id, prompt_len, max_tokens) -> str:
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


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--requests", type=int, default=20_000, help="decisions per policy for the pure router")
    parser.add_argument("--batch-size", type=int, default=500, help="route calls in flight at once through the actor")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--serial", type=int, default=300, help="one-at-a-time calls for the latency figure")
    parser.add_argument("--actor-policy", default="least_loaded", choices=sorted(ROUTING_POLICIES))
    parser.add_argument("--no-ray", action="store_true", help="measure the pure router only")
    args = parser.parse_args(argv)

    results: dict[str, float] = {}
    print(f"target: {TARGET:,.0f} decisions/s; {args.replicas} replicas")
    print(f"\n(a) pure Router, route + complete, {args.requests:,} decisions per policy")
    print(f"{'policy':<18} {'decisions/s':>12} {'x target':>9}")
    for policy in ROUTING_POLICIES:
        rate = pure_rate(policy, args.replicas, args.requests)
        results[f"pure/{policy}"] = rate
        print(f"{policy:<18} {rate:>12,.0f} {rate / TARGET:>9.1f}")
    if args.no_ray:
        return results

    print(f"\n(b) RouterActor ({args.actor_policy}) on local Ray, batches of {args.batch_size} calls in flight;")
    print("    no-op actors with the same calls as references (x ceiling: RouterActor / no-op actor)")
    measured = actor_rates(args.actor_policy, args.replicas, args.batch_size, args.batches, args.serial)
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
                f"{actor:<18} {label:<22} {value:>10} {rate:>12,.0f} {rate / TARGET:>9.2f} {rate / ceiling_rate:>10.2f}"
            )
    print("\n(c) RouterActor.route_many: one call carries a burst of arrivals (what the async client sends")
    print("    for requests routed in the same event-loop turn); one call in flight at a time")
    print(f"{'arrivals per call':<18} {'decisions/s':>12} {'x target':>9}")
    for burst, rate in bursts.items():
        results[f"route_many/{burst}"] = rate
        print(f"{burst:<18} {rate:>12,.0f} {rate / TARGET:>9.2f}")
    return results


if __name__ == "__main__":
    main()
