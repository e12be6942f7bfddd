"""What splitting prefix-aware routing across routers costs, in the simulator: the kv-pressure
experiment's cells (workloads/experiments/kv-pressure.toml: its four replicas, cost model,
loop and dispatch overheads, SLO) at `--load` for each of `--policies`, routed by 1, 2 and 4
routers (`SimulationConfig.routers`, as Ray Serve's ingresses each route on their own: request i
by router i mod N, which alone hears of its end, every router given every replica's load reports
and K/V events), on every seed of `--seeds`.

Prints the CPU, then per policy, router count and seed: the prefix hit rate and its share of the
best possible (`best_prefix_hit_rate`), the imbalance (max/mean output tokens over the
replicas), the TTFT p90, the goodput and the prefix index staleness (the share of the tokens a
router believed cached on its choice that were not there at admission), each with its ratio to the
1-router figure of the same seed (a verdict holds only where every seed agrees), and their median
over seeds with the ratios' range. Then the K/V event fan-out of each router count: per replica,
the load reports, the K/V event batches and their bytes (each `KvEvents` pickled) per simulated
second that one router receives (every router of a run receives the same; checked), and that
scaled to 1,000 replicas and R routers: each router receives 1,000 replicas' worth, each replica
sends R copies, the cluster R x 1,000. The rates are those of kv-pressure's fake model (the fitted cost
model x its cost_scale, 0.0625), whose steps are that much shorter than the calibrated model's:
a replica's batch rate follows its step rate (one report per step boundary, throttled).

    .venv/bin/python benchmarks/router_consistency.py
    .venv/bin/python benchmarks/router_consistency.py --policies precise_prefix --routers 1 8 --seeds 0
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from experiments.backends import SimulatedBackend, experiment_slo
from experiments.plan import plan_experiment
from metrics.definitions import summarize
from metrics.goodput_report import index_staleness
from protocol.cpu import cpu_info
from sim.simulator import SimulationResult, Simulator
from workloads.prefixes import best_prefix_hit_rate

EXPERIMENT = Path(__file__).resolve().parent.parent / "workloads" / "experiments" / "kv-pressure.toml"
FIGURES = ("hit", "hit/best", "imbalance", "ttft_p90", "goodput", "staleness")
SCALE_REPLICAS = 1000


def figures(result: SimulationResult, best: float, slo) -> dict[str, float]:
    """The run's figures as the reports define them (`metrics.goodput_report`)."""
    served = [t for t in result.traces if t.replica is not None]
    prefill = sum(s.num_prefill_tokens for steps in result.steps.values() for s in steps)
    hit = max(0.0, 1.0 - prefill / sum(t.prompt_len for t in served))
    tokens = Counter({rid: 0 for rid in result.steps})
    for t in served:
        tokens[t.replica] += t.num_output_tokens
    summary = summarize(result.traces, slo)
    stale = index_staleness(result.traces, [asdict(d) for d in result.decisions])["staleness"]
    return {
        "hit": hit,
        "hit/best": hit / best,
        "imbalance": max(tokens.values()) / statistics.mean(tokens.values()),
        "ttft_p90": summary.ttft["p90"],
        "goodput": summary.goodput,
        "staleness": float("nan") if stale is None else stale,
        "makespan": summary.makespan,
    }


def run(workload, config, cost) -> tuple[SimulationResult, list[Counter]]:
    """One run, with what each router received per replica: reports, K/V event batches, their bytes."""
    sim = Simulator(workload, config, cost)
    received = [Counter() for _ in sim.routers]
    for router, counts in zip(sim.routers, received):
        report = router.report

        def counted(load, report=report, counts=counts):
            counts["reports", load.replica_id] += 1
            if load.kv_events is not None:
                counts["batches", load.replica_id] += 1
                counts["bytes", load.replica_id] += len(pickle.dumps(load.kv_events))
            return report(load)

        router.report = counted
    return sim.run(), received


def fmt(name: str, value: float) -> str:
    if name in ("hit", "hit/best"):
        return f"{100 * value:5.1f}%"
    if name == "staleness":
        return f"{100 * value:5.2f}%"
    if name == "ttft_p90":
        return f"{value:6.3f}s"
    return f"{value:6.2f}" if name == "imbalance" else f"{value:7.1f}"


def ratio(value: float, base: float) -> float:
    return value / base if base else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["precise_prefix", "prefix_affinity"])
    parser.add_argument("--routers", nargs="+", type=int, default=[1, 2, 4], help="router counts (1 is added)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--load", type=float, default=0.8, help="x the cluster's measured capacity")
    args = parser.parse_args()
    counts = sorted({1, *args.routers})
    start = time.perf_counter()
    print(f"CPU: {cpu_info().describe()}", flush=True)
    plan = plan_experiment(EXPERIMENT, seeds=args.seeds, simulate=True, loads=[args.load])
    backend, slo = SimulatedBackend(plan, store=None), experiment_slo(plan)
    cells = {(c.routing, c.seed): c for c in plan.cells if c.routing in args.policies}
    capacity = backend.capacity(next(iter(cells.values())))
    print(f"{EXPERIMENT.name} at {args.load} x capacity ({capacity.decode_tokens_per_s:.0f} output tok/s), SLO {slo}")
    header = f"{'policy':16} {'routers':>7} {'seed':>4}  " + "  ".join(f"{f:>17}" for f in FIGURES)
    fanout: dict[tuple[str, int], list[dict[str, float]]] = {}  # per policy and router count, per seed
    for policy in args.policies:
        print(f"\n{header}")
        rows: dict[int, list[tuple[dict, dict]]] = {}
        for seed in args.seeds:
            cell = cells[policy, seed]
            workload = plan.workload(cell, capacity)
            config = backend._config(cell, policy, seed)
            best = best_prefix_hit_rate(workload, seed, config.vocab_size, config.engine.block_size)
            base = None
            for n in counts:
                result, received = run(workload, config.model_copy(update={"routers": n}), plan.cost)
                if any(r != received[0] for r in received):
                    raise SystemExit(f"{policy} seed {seed}: the {n} routers received different reports")
                values = figures(result, best, slo)
                base = base or values
                ratios = {f: ratio(values[f], base[f]) for f in FIGURES}
                rows.setdefault(n, []).append((values, ratios))
                per_second = config.num_replicas * values["makespan"]
                kinds = ("reports", "batches", "bytes")
                rate = {k: sum(v for (kind, _), v in received[0].items() if kind == k) / per_second for k in kinds}
                fanout.setdefault((policy, n), []).append(rate)
                cols = "  ".join(f"{fmt(f, values[f])} ({ratios[f]:4.2f}x)" for f in FIGURES)
                print(f"{policy:16} {n:7} {seed:4}  {cols}", flush=True)
        for n in counts:
            cols = []
            for f in FIGURES:
                med = statistics.median(v[f] for v, _ in rows[n])
                rs = [r[f] for _, r in rows[n]]
                cols.append(f"{fmt(f, med)} ({min(rs):.2f}-{max(rs):.2f})")
            print(f"{policy:16} {n:7} {'med':>4}  " + "  ".join(f"{c:>17}" for c in cols))
    print("\nK/V event fan-out: per replica, what each router receives per simulated second (median over seeds),")
    print(f"and that at {SCALE_REPLICAS:,} replicas with that many routers:")
    for (policy, n), rates in fanout.items():
        r = {k: statistics.median(x[k] for x in rates) for k in rates[0]}
        base = {k: statistics.median(x[k] for x in fanout[policy, 1]) for k in r}
        batches, nbytes = r["batches"] * SCALE_REPLICAS, r["bytes"] * SCALE_REPLICAS
        print(
            f"  {policy:16} {n} routers: {r['reports']:5.1f} reports/s ({ratio(r['reports'], base['reports']):.2f}x), "
            f"{r['batches']:5.1f} K/V batches/s ({ratio(r['batches'], base['batches']):.2f}x), "
            f"{r['bytes'] / 1e3:5.2f} kB/s ({ratio(r['bytes'], base['bytes']):.2f}x, "
            f"{r['bytes'] / r['batches']:.0f} B a batch)\n"
            f"  {'':16} x{SCALE_REPLICAS}: each router {batches:,.0f} batches/s {nbytes / 1e6:.2f} MB/s, "
            f"each replica sends {n * r['batches']:.1f} batches/s {n * r['bytes'] / 1e3:.2f} kB/s, "
            f"the cluster {n * batches:,.0f} batches/s {n * nbytes / 1e6:.2f} MB/s"
        )
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
