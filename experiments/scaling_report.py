"""What an experiment's cells cost where they size their cluster differently (`sweep.autoscale`,
`[cluster] autoscale`): replica-seconds (`replica_timeline`: the replicas alive over the run,
from its start size and the store's scaling decisions, read the same way for the simulator
and Ray), goodput per replica-second (output tokens of requests that met the SLO, over them),
scale events, the most replicas at once and the median cold start (`scaling_figures`, columns
of the experiment's table); the best autoscaling policy against the most provisioned
static cluster and against Ray Serve's autoscaler on the same engine (`against_static`, a
section of its report); and the timeline of each sized cell (`plot_scaling_timeline`: offered
load, replicas by state, TTFT p90 per window, an SVG beside the report)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from autoscaling.policies import AutoscaleConfig
from cluster.serve_baseline import SERVE_POLICY, SERVE_ROUTERS
from experiments.plan import AXES, Cell
from experiments.run import ExperimentResult
from metrics.definitions import percentiles
from metrics.store import MetricsStore
from workloads.capacity import Capacity

# key, header, format: shown where a cell's cluster is autoscaled or statically sized (`scaling_figures`)
SCALING_METRICS: list[tuple[str, str, str]] = [
    ("replica_seconds", "replica-s", "{:.0f}"),
    ("goodput_per_replica_s", "good tok/replica-s", "{:.2f}"),
    ("scale_events", "scale events", "{:.0f}"),
    ("peak_replicas", "peak replicas", "{:.0f}"),
    ("cold_start_s", "cold start s", "{:.2f}"),
]
ATTAINMENT_SHARE = 0.99  # an autoscaling policy competes when it keeps this share of static's SLO attainment
TIMELINE_WINDOW_S = 10.0  # the timeline's offered load and TTFT p90 are read per window this long
STATE_COLOURS = {"serving": "#4c72b0", "starting": "#dd8452", "draining": "#c44e52"}


class Row(Protocol):
    """A table row (`experiments.experiment_report.SummaryRow`): a cell, its runs, each figure per run."""

    cell: Cell
    run_ids: list[int]
    values: dict[str, list[float]]
    seeds: list[int]

    def per_seed(self, key: str) -> dict[int, float]: ...


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
    """The replicas alive over the run: `state_timeline`'s, in whichever state."""
    states = state_timeline(store, run_id)
    changes = [(states.start + t, sum(n)) for t, *n in states.points]
    return ReplicaTimeline(states.start, states.end, changes)


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
        partial = set(ref.seeds) != {s for r in group for s in r.seeds}  # set against the seeds it ran
        lines.append(
            f"{where + ': ' if where else ''}reference {ref.cell.scaling}: {ref_seconds:.0f} replica-s, "
            f"SLO met {ref_met:.1f}%"
            + (f" (seed{'s' * (len(ref.seeds) > 1)} {', '.join(map(str, ref.seeds))} only)" if partial else "")
        )
        eligible = []
        for r in scaled:
            seconds, met = statistics.median(r.values["replica_seconds"]), statistics.median(r.values["slo_attainment"])
            keeps = _keeps_attainment(r, ref, ATTAINMENT_SHARE)
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
                + (" both ran" if partial else "")
            )
        else:
            lines.append(f"best policy: none keeps {ATTAINMENT_SHARE:g}x of {ref.cell.scaling}'s SLO attainment")
    return lines + against_serve_autoscaler(result, rows)


def _keeps_attainment(row: Row, ref: Row, share: float) -> bool:
    """Whether `row` keeps `share` of `ref`'s SLO attainment on every seed both ran (one at
    least): the rule both comparisons pick a policy by."""
    theirs = ref.per_seed("slo_attainment")
    pairs = [(m, theirs[s]) for s, m in row.per_seed("slo_attainment").items() if s in theirs]
    return bool(pairs) and all(m >= share * rm for m, rm in pairs)


def against_serve_autoscaler(result: ExperimentResult, rows: list[Row]) -> list[str]:
    """Per cell Ray Serve's autoscaler sized (a Serve router, sized by `target_ongoing`), each of
    slotserve's autoscaling policies at the same point of the sweep against it, and the policy
    with the fewest replica-seconds among those that match its SLO attainment on every seed at no
    more replica-seconds (medians over seeds). A simulated plan, which has no Serve, says which
    of its cells stands for it."""
    scalings = result.plan.scalings
    if result.simulated:
        if result.plan.skipped and any(
            isinstance(s, AutoscaleConfig) and s.policy == SERVE_POLICY for s in scalings.values()
        ):
            return [f"Ray Serve's autoscaler runs on Ray only; simulated, its rule is the {SERVE_POLICY} cell's"]
        return []
    lines = []

    def autoscaled(r: Row) -> bool:
        return isinstance(scalings[r.cell.scaling], AutoscaleConfig) and bool(r.values.get("replica_seconds"))

    def median(r: Row, key: str) -> float:
        return statistics.median(r.values[key])

    for serve in [r for r in rows if r.cell.routing in SERVE_ROUTERS and autoscaled(r)]:
        point = [a for a in AXES if a not in ("routing", "scaling")]
        ours = [
            r
            for r in rows
            if r.cell.routing not in SERVE_ROUTERS
            and autoscaled(r)
            and all(getattr(r.cell, a) == getattr(serve.cell, a) for a in point)
        ]
        if not ours:
            continue
        seconds, met = median(serve, "replica_seconds"), median(serve, "slo_attainment")
        lines.append(
            f"Ray Serve's autoscaler ({serve.cell.routing}, {serve.cell.scaling}): {seconds:.0f} replica-s, "
            f"SLO met {met:.1f}%"
        )
        matching = []
        for r in ours:
            mine = median(r, "replica_seconds")
            if mine <= seconds and _keeps_attainment(r, serve, 1.0):
                matching.append((mine, r))
            lines.append(
                f"{r.cell.routing} {r.cell.scaling}: {mine / seconds:.2f}x its replica-seconds, "
                f"SLO met {median(r, 'slo_attainment'):.1f}%"
            )
        if matching:
            mine, best = min(matching, key=lambda m: m[0])
            lines.append(
                f"matches Ray Serve's autoscaler: {best.cell.scaling}, its SLO attainment on every seed at "
                f"{100 * (1 - mine / seconds):.0f}% fewer replica-seconds"
            )
        else:
            lines.append("matches Ray Serve's autoscaler: none, at its SLO attainment with no more replica-seconds")
    return lines


@dataclass(frozen=True)
class StateTimeline:
    """The replicas by state over one run (`start` to `end`, as `replica_timeline` says), as
    the scaling rows saw them: (seconds from `start`, serving, starting, draining) at the
    start and at each row that changed them."""

    start: float
    end: float
    points: list[tuple[float, int, int, int]]


def state_timeline(store: MetricsStore, run_id: int) -> StateTimeline:
    """From the run's first planned arrival (on the run's clock: virtual in the simulator, the
    wall clock on Ray) to its last step or completion: `num_replicas` of its config serving to
    begin with, then after each scaling decision the replicas it found in each state, those it
    started (wanted beyond the ones starting or serving) counted as starting; a replica it
    drains stays alive until the next decision sees it gone. Decisions sample the cluster every
    decision period, so a start or an end counts to within one period. A run on Ray Serve's
    autoscaler has the same rows, sampled from Serve's controller every decision period
    (`cluster.serve_baseline`), read by the same rule."""
    run, requests, steps = store.run(run_id), store.requests(run_id), store.steps(run_id)
    planned = [r["planned_arrival"] if r["planned_arrival"] is not None else r["arrival"] for r in requests]
    start = min((t for t in planned if t is not None), default=0.0)
    ends = [r["completion"] for r in requests if r["completion"] is not None]
    end = max([start, *ends, *(s["start"] + s["duration"] for s in steps)])
    initial = (run["config"] or {}).get("num_replicas") or len({s["replica_id"] for s in steps}) or 1
    points = [(0.0, initial, 0, 0)]
    for d in store.scaling(run_id):
        if start <= d["time"] <= end:
            i = d["inputs"]
            serving, starting, draining = int(i["serving"]), int(i["starting"]), int(i["draining"])
            asked = max(0, d["desired"] - serving - starting)
            if points[-1][1:] != (serving, starting + asked, draining):
                points.append((d["time"] - start, serving, starting + asked, draining))
    return StateTimeline(start, end, points)


def windows(
    store: MetricsStore, run_id: int, one_replica: Capacity, window_s: float = TIMELINE_WINDOW_S
) -> tuple[list[float], list[float], list[float | None]]:
    """Per `window_s` of the run, by planned arrival: the offered load in replicas (the work of
    the requests arriving then at `one_replica`'s capacity, over the window) and the TTFT p90
    of those that got a first token, as the table takes it (`metrics.definitions.percentiles`;
    None: none did)."""
    start = replica_timeline(store, run_id).start
    work: dict[int, float] = {}
    ttfts: dict[int, list[float]] = {}
    for r in store.requests(run_id):
        planned = r["planned_arrival"] if r["planned_arrival"] is not None else r["arrival"]
        if planned is None:
            continue
        k = int((planned - start) // window_s)
        output = r["max_tokens"] if r["max_tokens"] is not None else r["output_len"] or 0
        work[k] = work.get(k, 0.0) + one_replica.work_seconds(r["prompt_len"], output)
        if r["first_token"] is not None and r["arrival"] is not None:
            ttfts.setdefault(k, []).append(r["first_token"] - r["arrival"])
    times = [(k + 0.5) * window_s for k in range(max(work, default=-1) + 1)]
    load = [work.get(k, 0.0) / window_s for k in range(len(times))]
    p90 = [percentiles(ttfts.get(k, []))["p90"] for k in range(len(times))]
    return times, load, p90


def plot_scaling_timeline(result: ExperimentResult, rows: list[Row], out: Path) -> list[tuple[str, Path]]:
    """Where cells size their cluster: for each such row (its first seed's run) the offered load
    over the replicas by state, and the TTFT p90 per window against the SLO's limit, as
    `scaling_timeline.svg` in `out`. Empty (nothing written) without sized rows."""
    sized = [r for r in rows if result.plan.scalings.get(r.cell.scaling) is not None and r.run_ids]
    if not sized:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    plan = result.plan
    routings = len({r.cell.routing for r in sized}) > 1
    store = MetricsStore(result.store_path)
    matplotlib.rcParams["svg.hashsalt"] = "slotserve"  # the same runs write the same file
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text, not glyph outlines: a smaller file
    fig, axes = plt.subplots(len(sized), 2, figsize=(13, 2.4 * len(sized)), squeeze=False, sharex=True)
    try:
        for (left, right), r in zip(axes, sized):
            run_id = r.run_ids[0]
            one = plan.replica_capacity(result.capacities[r.cell.slots])
            times, load, p90 = windows(store, run_id, one)
            timeline = state_timeline(store, run_id)
            states = timeline.points
            xs = [t for t, *_ in states] + [timeline.end - timeline.start]
            below = [0] * len(xs)
            for j, state in enumerate(STATE_COLOURS):
                layer = [p[1 + j] for p in states] + [states[-1][1 + j]]
                top = [b + n for b, n in zip(below, layer)]
                left.fill_between(xs, below, top, step="post", color=STATE_COLOURS[state], alpha=0.7, label=state)
                below = top
            left.plot(times, load, color="black", lw=1.2, label="offered load")
            name = f"{r.cell.routing} {r.cell.scaling}" if routings else r.cell.scaling
            left.set_ylabel("replicas")
            left.set_title(f"{name}: replicas by state, offered load ({TIMELINE_WINDOW_S:g} s windows)", fontsize=9)
            shown = [(t, v) for t, v in zip(times, p90) if v is not None]
            right.plot([t for t, _ in shown], [v for _, v in shown], color="#55a868", marker=".", lw=1)
            right.axhline(plan.experiment.slo.ttft, color="grey", ls="--", lw=0.8, label="TTFT SLO")
            right.set_yscale("log")
            right.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))  # labelled: a run may span under a decade
            for formatter in (right.yaxis.set_major_formatter, right.yaxis.set_minor_formatter):
                formatter(FormatStrFormatter("%g"))
            right.set_ylabel("TTFT p90 (s)")
            right.set_title(f"{name}: TTFT p90 per {TIMELINE_WINDOW_S:g} s window", fontsize=9)
        axes[0][0].legend(fontsize=7, loc="upper right", ncol=4)
        axes[0][1].legend(fontsize=7, loc="upper left")
        for ax in axes[-1]:
            ax.set_xlabel("seconds from the first arrival")
        kind = "simulated" if result.simulated else "real"
        fig.suptitle(f"{plan.experiment.name} ({kind}): each sizing's first-seed run", fontsize=10)
        fig.tight_layout()
        path = out / "scaling_timeline.svg"
        fig.savefig(path, format="svg", metadata={"Date": None})
    finally:
        plt.close(fig)
        store.close()
    return [("Scaling timeline", path)]
