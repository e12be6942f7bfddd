"""Live metrics end to end: a real Prometheus server (Debian's `prometheus`, started here on a
free loopback port) scrapes a local Ray cluster of 2 fake-model replicas under load through
Ray's service-discovery file, then every PromQL expression of every dashboard panel is
evaluated through Prometheus's HTTP API, the dashboard's occupancy is compared with the steps
the replicas recorded in the store, the panels are rendered, and `slotserve top` runs under a
pseudo-terminal. One cluster and one Prometheus serve the whole module (about a minute)."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import os
import pty
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from autoscaling.policies import AutoscaleConfig
from cluster.client import Client
from cluster.deploy import ClusterSpec, start_cluster, stop_cluster
from cluster.driver import run_workload
from cluster.prometheus_exporters import write_service_discovery
from dashboards.build import DASHBOARD_FILE, prometheus_config
from dashboards.panels import OCCUPANCY
from dashboards.prometheus import Prometheus
from dashboards.queries import fill, panel_queries
from dashboards.render import render
from metrics.definitions import SLO
from metrics.store import MetricsStore
from protocol.flow import FlowConfig
from protocol.routing import RouteRequest
from replica import EngineConfig
from replica.serving.loop import ReplicaConfig
from tests.waiting import wait_until
from workloads import bursty_mix

ROOT = Path(__file__).resolve().parent.parent
REPLICAS = {"replica-0", "replica-1"}
# Paged K/V of 256 tokens for 4 slots: 4 requests of ~180 tokens cannot all hold theirs, so a
# burst preempts; identical prompts hit the prefix cache.
FAKE = ReplicaConfig(
    engine=EngineConfig(
        num_slots=4, max_seq_len=256, kv_budget_tokens=256, kv_cache="paged", block_size=16, prefix_caching=True
    ),
    fake_step_seconds=0.01,
)
# The autoscaling controller runs (its panels need its series) but is held at the 2 replicas
# the other panels are checked against.
HELD_AT_TWO = AutoscaleConfig(policy="target_ongoing", min_replicas=2, max_replicas=2)
WINDOW = 6.0  # seconds: the rate window put in for Grafana's $__rate_interval

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="Debian's prometheus binary is not installed (`make setup` installs it with apt-get where it can)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _pressure(client: Client) -> None:
    """8 long requests at once: least_loaded puts 4 on each replica, whose K/V cannot hold them."""
    await asyncio.gather(
        *[client.agenerate(list(range(i * 60, i * 60 + 60)), max_tokens=120, ignore_eos=True) for i in range(8)]
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    ray.init(
        address="local",
        num_cpus=4,
        namespace="slotserve",
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    prometheus = None
    try:
        deployment = start_cluster(
            ClusterSpec(
                num_replicas=2,
                replica=FAKE,
                store_path=str(tmp / "store.db"),
                slo=SLO(ttft=5.0, tpot=0.5),
                autoscale=HELD_AT_TWO,
                flow=FlowConfig(),  # fcfs: the flow-control panels have their series, and nothing is held
            )
        )
        discovery = write_service_discovery()
        port = _free_port()
        config = tmp / "prometheus.yml"
        config.write_text(prometheus_config(str(discovery), interval="1s"))
        prometheus = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        api = Prometheus(f"http://127.0.0.1:{port}")
        wait_until(api.ready, 60, "Prometheus to start", every=0.5)

        client = Client()
        started = time.time()
        shared = list(range(100, 164))  # four full blocks, sent four times: the prefix cache hits
        for _ in range(4):
            client.generate(shared, max_tokens=4, ignore_eos=True)
        asyncio.run(_pressure(client))
        with pytest.raises(Exception, match="too long|exceeds"):  # refused by the replica: outcome "rejected"
            client.generate(list(range(300)), max_tokens=4)
        ray.get(deployment.router.route.remote(RouteRequest("twice", 4, 4)))
        with pytest.raises(ray.exceptions.RayTaskError, match="already in flight"):  # a router rejection
            ray.get(deployment.router.route.remote(RouteRequest("twice", 4, 4)))
        ray.get(deployment.router.complete.remote("twice"))

        workload = bursty_mix(num_requests=160, rate=7.0, seed=3)
        load_start = time.time()
        run_id = run_workload(
            deployment,
            workload,
            name="live",
            config={},
            batching_policy="continuous",
            routing_policy="least_loaded",
            progress=False,
        )
        load_end = time.time()
        store = MetricsStore(tmp / "store.db")
        steps = store.steps(run_id)
        # Wait until Prometheus has the run's last step (export every 1 s, scrape every 1 s).
        count = f'sum(slotserve_steps_total{{run="{run_id}"}})'

        def all_steps_in() -> bool:
            answer = api.query(count)
            return bool(answer) and answer[0].points[0][1] == len(steps)

        wait_until(all_steps_in, 90, "the run's steps in Prometheus", every=0.5)
        yield {
            "api": api,
            "deployment": deployment,
            "run_id": run_id,
            "steps": steps,
            "started": started,
            "load": (load_start, load_end),
            "tmp": tmp,
        }
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        stop_cluster()
        ray.shutdown()


def test_every_panel_query_returns_data_with_the_labels_it_splits_by(live):
    """Each target of each panel, evaluated during the load, returns finite values; a target
    split by replica returns exactly one series per replica; one split by nothing, exactly one."""
    api, load_end = live["api"], live["load"][1]
    window = f"{int(load_end - live['started']) + 5}s"  # the whole time traffic ran, extras included
    queries = panel_queries(DASHBOARD_FILE, window)
    assert len({q.panel for q in queries}) >= 20
    failures = []
    for q in queries:
        result = api.query(q.expr, at=load_end)
        finite = [s for s in result if s.finite]
        if not finite:
            failures.append(f"{q.panel} [{q.ref}]: no data for {q.expr}")
            continue
        keys = [tuple(s.labels.get(label, "") for label in q.split_by) for s in finite]
        if "replica" in q.split_by and {s.labels["replica"] for s in finite} != REPLICAS:
            failures.append(f"{q.panel} [{q.ref}]: replicas {sorted(keys)}, expected {sorted(REPLICAS)}")
        if len(set(keys)) != len(keys) or any("" in k for k in keys):
            failures.append(f"{q.panel} [{q.ref}]: series {keys} not one per value of {q.split_by}")
        if not q.split_by and len(finite) != 1:
            failures.append(f"{q.panel} [{q.ref}]: {len(finite)} series, expected one")
    assert not failures, "\n".join(failures)


def _steps_summing_to(sums: list[int], total: float, near: int) -> int:
    """How many of a replica's first steps have live slots summing to `total` (`sums` is their
    running sum, from 0): the count nearest `near` where idle steps make several fit."""
    lo, hi = bisect.bisect_left(sums, total), bisect.bisect_right(sums, total)
    assert lo < hi, f"{total:g} live slots is not the sum of any run of the replica's first steps"
    return min(range(lo, hi), key=lambda n: abs(n - near))


def _unclamped(points: list[tuple[float, float]], window_start: float) -> bool:
    """Whether Prometheus's rate() extrapolates this counter's window to its start unclamped:
    it stops at the time the counter would reach zero when that comes sooner, and a ratio of two
    rates is the ratio of their increases only when neither is clamped."""
    (t0, v0), (t1, v1) = points[0], points[-1]
    return v1 == v0 or (t1 - t0) * v0 / (v1 - v0) >= t0 - window_start


def test_dashboard_occupancy_agrees_with_the_replicas_step_samples(live):
    """The run's counters in Prometheus hold exactly the store's steps: every scraped value of
    the live-slot counter is the sum over a run of the replica's first steps, at most a few steps
    from the step counter of the same scrape (Ray exports the two counters one after the other
    while the replica steps on) and in the median scrape at it. The dashboard's occupancy over a
    6 s window, taken every second of the load, is exactly those counters' ratio, so it equals
    the mean occupancy of the steps its counters moved by: exactly in most windows, and in every
    one within the steps the two counters' snapshots were apart. And the counters are timely: a
    scraped count never holds a step that had not started, and by the median scrape it holds
    every step started 3 s before."""
    api, run_id, steps = live["api"], live["run_id"], live["steps"]
    by_replica = {replica: [s for s in steps if s["replica_id"] == replica] for replica in REPLICAS}
    sums = {r: list(itertools.accumulate((s["live_slots"] for s in mine), initial=0)) for r, mine in by_replica.items()}
    slots = {r: {s["num_slots"] for s in mine} for r, mine in by_replica.items()}
    assert all(len(n) == 1 for n in slots.values()), slots
    for replica, mine in by_replica.items():
        total = api.query(f'slotserve_step_live_slots_total{{run="{run_id}", replica="{replica}"}}')
        count = api.query(f'slotserve_steps_total{{run="{run_id}", replica="{replica}"}}')
        assert count[0].points[0][1] == len(mine)
        assert total[0].points[0][1] == sums[replica][-1]

    load_start, load_end = live["load"]
    expr = fill(OCCUPANCY, f"{WINDOW:g}s")
    exact, against_steps, straddles, lags = [], [], [], []
    for at in range(int(load_start + WINDOW + 2), int(load_end)):
        for series in api.query(expr, at=at):
            replica = series.labels["replica"]
            if not series.finite:
                continue
            mine, (num_slots,) = by_replica[replica], slots[replica]  # steps in order of start
            selector = f'{{run="{run_id}", replica="{replica}"}}[{WINDOW:g}s]'
            (counts,) = api.query(f"slotserve_steps_total{selector}", at=at)
            (lives,) = api.query(f"slotserve_step_live_slots_total{selector}", at=at)
            (_, first), (last_time, last) = counts.points[0], counts.points[-1]
            first, last = int(first), int(last)
            lo = _steps_summing_to(sums[replica], lives.points[0][1], first)
            hi = _steps_summing_to(sums[replica], lives.points[-1][1], last)
            straddles += [abs(lo - first), abs(hi - last)]
            value = series.points[0][1]
            same_scrapes = [t for t, _ in counts.points] == [t for t, _ in lives.points]
            if last > first and same_scrapes and all(_unclamped(s.points, at - WINDOW) for s in (counts, lives)):
                exact.append(abs(value - (sums[replica][hi] - sums[replica][lo]) / (last - first) / num_slots))
                # steps lo..first and hi..last counted on one side only, each at most 1 slot in 1
                bound = (abs(lo - first) + abs(hi - last)) / (last - first)
                mean = (sums[replica][last] - sums[replica][first]) / (last - first) / num_slots
                against_steps.append((abs(value - mean), bound))
            assert last == 0 or mine[last - 1]["start"] < last_time, f"{replica} counted a step not yet begun"
            if last < len(mine):  # the oldest step not yet counted: how late the count is
                lags.append(last_time - mine[last]["start"])
    assert len(exact) >= 10, f"{len(exact)} windows in a load of {load_end - load_start:.1f} s"
    lags.sort()
    straddles.sort()
    print(
        f"occupancy, dashboard vs store: {len(exact)} windows, max |diff| {max(d for d, _ in against_steps):.4f}; "
        f"counters' snapshots apart by median {straddles[len(straddles) // 2]}, max {straddles[-1]} steps; "
        f"export lag median {lags[len(lags) // 2]:.2f} s, max {lags[-1]:.2f} s"
    )
    assert max(exact) <= 1e-9
    assert straddles[len(straddles) // 2] == 0
    assert sorted(d for d, _ in against_steps)[len(against_steps) // 2] <= 1e-9
    assert all(d <= bound + 1e-9 for d, bound in against_steps), max(against_steps)
    assert lags[len(lags) // 2] <= 3.0


def test_render_draws_every_panel_with_data(live):
    """`dashboard render`'s drawing: one PNG per panel and the overview page, no panel empty."""
    out = live["tmp"] / "render"
    load_end = live["load"][1]
    panels = render(live["api"], DASHBOARD_FILE, out, live["started"], load_end + 3, step=1.0, window="10s")
    assert [p.title for p in panels if p.empty] == []
    assert len(list(out.glob("*.png"))) == len(panels) + 1
    assert (out / "dashboard.png").stat().st_size > 50_000


def test_top_draws_live_frames_in_a_pseudo_terminal(live):
    """`slotserve top` under a pty: it switches to the alternate screen, draws 3 frames in place
    (each clears the last), one line per replica, occupancy above 0 while requests run, and
    tokens/s from the second frame on."""
    client = Client()
    busy = threading.Thread(target=lambda: asyncio.run(_pressure(client)))
    busy.start()
    address = ray.get_runtime_context().gcs_address
    controller, terminal = pty.openpty()
    top = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "top", "--address", address, "--count", "3", "--interval", "0.7"],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        close_fds=True,
        cwd=ROOT,
    )
    os.close(terminal)
    screen = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: top exited
            break
        if not chunk:
            break
        screen += chunk
    assert top.wait(timeout=120) == 0, screen.decode(errors="replace")[-2000:]
    os.close(controller)
    busy.join(timeout=120)
    text = screen.decode()
    assert text.index("\x1b[?1049h") < text.index("\x1b[H\x1b[2J") < text.rindex("\x1b[?1049l")
    frames = text.split("\x1b[H\x1b[2J")[1:]
    assert len(frames) == 3
    # an autoscaled cluster's rows carry each replica's state ("serving") before its occupancy
    line = r"^(replica-\d)\s+(?:serving\s+)?\[[#.]+\]\s+(\d+)%\s+\d+/4 .*?(\S+)\s+\S+ ms\s*$"
    rows = [re.findall(line, f, re.M) for f in frames]
    assert all({r[0] for r in frame} == REPLICAS for frame in rows), frames[-1]
    assert any(int(r[1]) > 0 for frame in rows for r in frame), frames
    assert all(r[2] != "-" for frame in rows[1:] for r in frame), frames[-1]
    print(frames[-1].replace("\r", ""))
