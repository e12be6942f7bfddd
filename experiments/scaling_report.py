"""What an experiment's cells cost where they size their cluster differently (`sweep.autoscale`,
`[cluster] autoscale`): replica-seconds (`replica_timeline`: the replicas alive over the run,
from its start size and the store's scaling decisions, read the same way for the simulator
and Ray), goodput per replica-second (output tokens of requests that met the SLO, over them),
scale events, the most replicas at once and the median cold start (`scaling_figures`, columns
of the experiment's table); and the best autoscaling policy against the most provisioned
static cluster (`against_static`, a section of its report)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Protocol

from autoscaling.policies import AutoscaleConfig
from experiments.plan import AXES, Cell
from experiments.run import ExperimentResult
from metrics.store import MetricsStore

# key, header, format: shown where a cell's cluster is autoscaled or statically sized (`scaling_figures`)
SCALING_METRICS: list[tuple[str, str, str]] = [
    ("replica_seconds", "replica-s", "{:.0f}"),
    ("goodput_per_replica_s", "good tok/replica-s", "{:.2f}"),
    ("scale_events", "scale events", "{:.0f}"),
    ("peak_replicas", "peak replicas", "{:.0f}"),
    ("cold_start_s", "cold start s", "{:.2f}"),
]
ATTAINMENT_SHARE = 0.99  # an autoscaling policy competes when it keeps this share of static's SLO attainment


class Row(Protocol):
    """A table row (`experiments.experiment_report.SummaryRow`): a cell, its runs, each figure per run."""

    cell: Cell
    run_ids: list[int]
    values: dict[str, list[float]]


@dataclass(frozen=True)
class ReplicaTimeline:
    """The replicas alive (starting, serving or draining) over one run: `changes` are (time,
    replicas alive from then on), the first at the run's `start`."""

    start: float
    end: float
    changes: list[tuple[float, int]]

    @property
    def replica_seconds(self) -> float:
        edges = [t for t, _ in self.changes[1:]] + [self.end]
        return sum(n * (until - since) for (since, n), until in zip(self.changes, edges))

    @property
    def peak(self) -> int:
        return max(n for _, n in self.changes)


def replica_timeline(store: MetricsStore, run_id: int) -> ReplicaTimeline:
    """From the run's first planned arrival (time 0 of its workload, on the run's clock) to its
    last step or completion: `num_replicas` of its config to begin with, then after each
    scaling decision the replicas it found alive plus those it started (a replica it drains
    stays alive until the next decision sees it gone). Decisions sample the cluster every
    decision period, so a start or an end counts to within one period."""
    run, requests, steps = store.run(run_id), store.requests(run_id), store.steps(run_id)
    timed = [r for r in requests if r["arrival"] is not None and r["planned_arrival"] is not None]
    start = min((r["arrival"] - r["planned_arrival"] for r in timed), default=None)
    if start is None:
        start = min((r["arrival"] for r in requests if r["arrival"] is not None), default=0.0)
    ends = [r["completion"] for r in requests if r["completion"] is not None]
    end = max([start, *ends, *(s["start"] + s["duration"] for s in steps)])
    initial = (run["config"] or {}).get("num_replicas") or len({s["replica_id"] for s in steps}) or 1
    changes = [(start, initial)]
    for d in store.scaling(run_id):
        if start <= d["time"] <= end:
            i = d["inputs"]
            alive = int(i["serving"] + i["starting"] + i["draining"]) + max(0, d["desired"] - d["current"])
            changes.append((d["time"], alive))
    return ReplicaTimeline(start, end, changes)


def scaling_figures(store: MetricsStore, run_id: int, cluster: dict) -> dict[str, float | None]:
    """What one run's cluster cost (`SCALING_METRICS`), `cluster` its analysis's cluster scope."""
    timeline = replica_timeline(store, run_id)
    seconds = timeline.replica_seconds
    good_tokens = cluster["goodput"] * cluster["makespan"]
    colds = [c["ready_s"] for c in store.cold_starts(run_id)]
    return {
        "replica_seconds": seconds,
        "goodput_per_replica_s": good_tokens / seconds if seconds > 0 else None,
        "scale_events": float(sum(d["desired"] != d["current"] for d in store.scaling(run_id))),
        "peak_replicas": float(timeline.peak),
        "cold_start_s": statistics.median(colds) if colds else None,
    }


def against_static(result: ExperimentResult, rows: list[Row]) -> list[str]:
    """Per point of the sweep with static and autoscaled rows: the most provisioned static row
    (most replica-seconds, median over seeds) against each autoscaling policy, and the best
    policy: the fewest replica-seconds among those whose SLO attainment is at least
    `ATTAINMENT_SHARE` of that static row's on every seed. Empty without both kinds."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.values.get("replica_seconds"):
            groups.setdefault(tuple(getattr(r.cell, a) for a in AXES if a != "scaling"), []).append(r)
    lines = []
    for group in groups.values():
        kinds = {r.cell.scaling: result.plan.scalings[r.cell.scaling] for r in group}
        static = [r for r in group if not isinstance(kinds[r.cell.scaling], AutoscaleConfig)]
        scaled = [r for r in group if isinstance(kinds[r.cell.scaling], AutoscaleConfig)]
        if not static or not scaled:
            continue
        ref = max(static, key=lambda r: statistics.median(r.values["replica_seconds"]))
        ref_seconds = statistics.median(ref.values["replica_seconds"])
        ref_met = statistics.median(ref.values["slo_attainment"])
        varied = [a for a in AXES if a != "scaling" and len({getattr(r.cell, a) for r in rows}) > 1]
        where = " ".join(f"{a}={getattr(ref.cell, a)}" for a in varied)
        lines.append(
            f"{where + ': ' if where else ''}reference {ref.cell.scaling}: {ref_seconds:.0f} replica-s, "
            f"SLO met {ref_met:.1f}%"
        )
        eligible = []
        for r in scaled:
            seconds, met = statistics.median(r.values["replica_seconds"]), statistics.median(r.values["slo_attainment"])
            keeps = len(r.run_ids) == len(ref.run_ids) and all(
                m >= ATTAINMENT_SHARE * rm for m, rm in zip(r.values["slo_attainment"], ref.values["slo_attainment"])
            )
            if keeps:
                eligible.append((seconds, r))
            lines.append(
                f"{r.cell.scaling}: {seconds / ref_seconds:.2f}x its replica-seconds at {met / ref_met:.3f}x its "
                f"SLO attainment{'' if keeps else f' (below {ATTAINMENT_SHARE:g}x on a seed)'}"
                if ref_met
                else f"{r.cell.scaling}: {seconds / ref_seconds:.2f}x its replica-seconds"
            )
        if eligible:
            seconds, best = min(eligible, key=lambda e: e[0])
            lines.append(
                f"best policy: {best.cell.scaling}, {100 * (1 - seconds / ref_seconds):.0f}% fewer replica-seconds "
                f"than {ref.cell.scaling} at >= {ATTAINMENT_SHARE:g}x its SLO attainment on every seed"
            )
        else:
            lines.append(f"best policy: none keeps {ATTAINMENT_SHARE:g}x of {ref.cell.scaling}'s SLO attainment")
    return lines
