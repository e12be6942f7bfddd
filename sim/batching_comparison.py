"""Compare batching policies on one replica of a real model, on the same traffic.

One model runner is shared by every policy (same weights, same cache memory), the load is
stated as a multiple of the replica's measured capacity (decoding and prefilling with every
slot busy, `workloads.capacity`), and each policy replays the same seeded workload. Prints a
table and writes traces, step records, a summary and a plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from metrics.definitions import SLO, slot_efficiency, summarize
from replica.config import EngineConfig
from replica.engine import Engine
from replica.model.runner import ModelRunner
from sim.replay import ReplayResult, replay
from workloads.capacity import Capacity, probe_capacity
from workloads.standard import at_load


def measure_capacity(runner: ModelRunner, num_slots: int, max_seq_len: int) -> Capacity:
    """One replica's capacity on this runner, by the probes a cluster is measured with
    (`workloads.capacity.probe_capacity`), each replayed through a fresh engine (an empty
    prefix cache) on the wall clock."""
    config = EngineConfig(policy="mixed", num_slots=num_slots, max_seq_len=max_seq_len)
    return probe_capacity(
        lambda probe: replay(Engine(config, runner), probe, seed=probe.seed).traces, num_slots, max_seq_len
    )


def compare_policies(
    policies: list[str],
    workload: str,
    num_requests: int,
    load: float,
    num_slots: int,
    max_seq_len: int,
    token_budget: int,
    model: str,
    dtype: str,
    seed: int,
    slo: SLO,
    out_dir: Path | None = None,
    progress: bool = True,
) -> dict:
    """Each policy replays the same traffic at `load` x the measured capacity; the
    arguments are `slotserve compare`'s flags, whose defaults are the only ones."""
    runner = ModelRunner(EngineConfig(model=model, num_slots=num_slots, max_seq_len=max_seq_len, dtype=dtype))
    capacity = measure_capacity(runner, num_slots, max_seq_len)
    traffic = at_load(workload, num_requests, load, capacity, seed)
    rate = traffic.params.get("mean_rate_requests_per_s", 0.0)
    rows, results = [], {}
    for policy in policies:
        config = EngineConfig(
            policy=policy,
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            token_budget=token_budget,
            model=model,
            dtype=dtype,
        )
        result = replay(Engine(config, runner), traffic, seed=seed, progress=progress, desc=policy)
        results[policy] = result
        s = summarize(result.traces, slo)
        rows.append(
            {
                "policy": policy,
                "throughput": s.throughput,
                "goodput": s.goodput,
                "slo_attainment": s.slo_attainment,
                "ttft_p50": s.ttft["p50"],
                "ttft_p99": s.ttft["p99"],
                "tpot_p50": s.tpot["p50"],
                "itl_p99": s.itl["p99"],
                "itl_max": s.itl["max"],
                "slot_efficiency": slot_efficiency(
                    (r.useful_rows for r in result.steps), (r.computed_rows for r in result.steps)
                ),
                "preemptions": s.num_preemptions,
                "max_submit_lateness": max(result.submit_lateness, default=0.0),
            }
        )
    report = {
        "workload": traffic.describe(),
        "workload_params": traffic.params,
        "load": load,
        **capacity.as_params(),
        "rate_requests_per_s": rate,
        "num_slots": num_slots,
        "token_budget": token_budget,
        "model": model,
        "dtype": dtype,
        "slo": asdict(slo),
        "rows": rows,
    }
    if out_dir is not None:
        write_outputs(Path(out_dir), report, results)
    return report


def format_comparison(report: dict) -> str:
    head = (
        f"{'policy':<11}{'tok/s':>8}{'goodput':>9}{'SLO %':>7}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'ITL p99':>9}{'ITL max':>9}{'slot eff':>9}{'preempt':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        ms = lambda v: f"{1000 * v:.0f}ms" if v is not None else "-"  # noqa: E731
        lines.append(
            f"{r['policy']:<11}{r['throughput']:>8.1f}{r['goodput']:>9.1f}{100 * r['slo_attainment']:>6.0f}%"
            f"{ms(r['ttft_p50']):>10}{ms(r['ttft_p99']):>10}{ms(r['tpot_p50']):>10}{ms(r['itl_p99']):>9}"
            f"{ms(r['itl_max']):>9}{r['slot_efficiency']:>9.3f}{r['preemptions']:>8}"
        )
    slo = report["slo"]
    lines.append(
        f"workload: {report['workload']}; load {report['load']}x of measured capacity "
        f"({report['capacity_tokens_per_s']:.1f} decode and {report['capacity_prefill_tokens_per_s']:.0f} "
        f"prompt tokens/s at {report['num_slots']} slots) = "
        f"{report['rate_requests_per_s']:.2f} requests/s; chunked token budget {report['token_budget']}; "
        f"SLO: TTFT <= {slo['ttft']} s, TPOT <= {slo['tpot']} s"
    )
    return "\n".join(lines)


def write_outputs(out_dir: Path, report: dict, results: dict[str, ReplayResult]) -> None:
    from metrics.plots import colors, figure_legend, latency_cdfs, line_handles, plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(report, indent=2))
    with open(out_dir / "traces.jsonl", "w") as f:
        for policy, result in results.items():
            for t in result.traces:
                f.write(json.dumps({"policy": policy, **asdict(t)}) + "\n")
    with open(out_dir / "steps.jsonl", "w") as f:
        for policy, result in results.items():
            for s in result.steps:
                f.write(json.dumps({"policy": policy, **asdict(s)}) + "\n")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), layout="constrained")
    names = [r["policy"] for r in report["rows"]]
    policy_colors = colors(names)
    axes[0].bar(names, [r["throughput"] for r in report["rows"]], color=[policy_colors[n] for n in names], alpha=0.35)
    axes[0].bar(names, [r["goodput"] for r in report["rows"]], color=[policy_colors[n] for n in names])
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_title("goodput (solid) within throughput (pale)", fontsize=9)
    latency_cdfs(axes[1], axes[2], {policy: [result.traces] for policy, result in results.items()}, policy_colors)
    figure_legend(fig, line_handles(policy_colors))
    fig.suptitle(report["workload"], fontsize=9)
    fig.savefig(out_dir / "policies.png", dpi=100)
    plt.close(fig)
