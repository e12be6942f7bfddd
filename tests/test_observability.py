# Over 400 lines: the live-metrics and plot tests share one exporter and one store layout.
"""Live metrics without a cluster: the dashboard files are what the generator writes, every
query names exported metrics, the replica exporter's per-request and goodput arithmetic on a
fake clock, and `dashboard push` against a local HTTP server that holds every request to
Grafana's documented HTTP API (no Grafana server can be installed on these machines)."""

from __future__ import annotations

import base64
import json
import re
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli.main import main
from cluster.prometheus_exporters import ReplicaExporter, RouterExporter
from dashboards import build
from dashboards.push import GrafanaPushError, push
from dashboards.queries import panel_queries
from metrics.definitions import SLO
from metrics.live import METRICS
from protocol.clock import FakeClock
from protocol.routing import RouteRequest
from replica import Engine, EngineConfig
from replica.model.fake import FlatCostModel, ScriptedFakeRunner
from router.router import Router


def test_committed_dashboard_files_are_what_the_generator_writes():
    """One source: `python -m dashboards.build` rewrites every file in dashboards/ unchanged."""
    for path, text in build.files().items():
        assert path.read_text() == text, (
            f"{path} differs from dashboards/build.py's output: run python -m dashboards.build"
        )


def test_every_query_names_exported_metrics_and_filters_by_the_variables():
    """Each panel's PromQL uses only metrics the exporters define, with their labels, and the
    dashboard's variables (cluster, model, replica, run) where the metric has the label."""
    dashboard = json.loads(build.DASHBOARD_FILE.read_text())
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "cluster", "model", "replica", "run"]
    exported = {m.name for m in METRICS.values()}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            selectors = re.findall(r"(slotserve_\w+)\{([^}]*)\}", target["expr"])
            assert selectors, panel["title"]
            for series, matchers in selectors:
                name = re.sub(r"_(bucket|sum|count)$", "", series)
                assert name in exported, (panel["title"], name)
                wanted = ['SessionName=~"$cluster"'] + [
                    f'{label}=~"${label}"' for label in ("model", "replica", "run") if label in METRICS[name].labels
                ]
                assert all(w in matchers for w in wanted), (panel["title"], series, matchers)
    queries = panel_queries(build.DASHBOARD_FILE, "30s", {"run": "7"})
    assert all("$" not in q.expr for q in queries) and any('run=~"7"' in q.expr for q in queries)


class _Recorder:
    """Stands in for the Ray metric objects: what the exporter recorded, by name and labels."""

    def __init__(self):
        self.values: dict[tuple, float] = defaultdict(float)
        self.observed: dict[str, list[float]] = defaultdict(list)

    def inc(self, name, value, tags):
        if value > 0:
            self.values[(name, tuple(sorted(tags.items())))] += value

    def observe(self, name, value, tags):
        self.observed[name].append(value)

    def set(self, name, value, tags):
        self.values[(name, tuple(sorted(tags.items())))] = value

    def total(self, name: str, **labels: str) -> float:
        return sum(v for (n, tags), v in self.values.items() if n == name and labels.items() <= dict(tags).items())


def test_replica_exporter_counts_tokens_latencies_and_goodput_on_a_fake_clock():
    """Three requests of 5 tokens on 2 slots, 10 ms per step: 15 tokens, 3 TTFTs and 12 ITLs
    of the engine's own token times; the third waits for a slot, so its TTFT misses a 30 ms
    SLO; a refused request is a missed SLO and outcome `rejected`; the run labels the counts."""
    clock = FakeClock()
    engine = Engine(EngineConfig(num_slots=2, max_seq_len=64), ScriptedFakeRunner(clock, FlatCostModel(0.01)), clock)
    exporter = ReplicaExporter("r0", engine, model="fake", slo=SLO(ttft=0.03, tpot=1.0), refresh=None)
    exporter.series = recorder = _Recorder()
    exporter.set_run(7)
    for i in range(3):
        exporter.on_submit(engine.add_request([1, 2, 3, i], {"max_tokens": 5, "ignore_eos": True}, f"q{i}"))
    _run_engine(exporter, engine)
    exporter.on_reject("q-bad")

    assert recorder.total("generation_tokens_total", run="7") == 15
    assert recorder.total("prompt_tokens_total") == 12
    assert len(recorder.observed["time_to_first_token_seconds"]) == 3
    assert len(recorder.observed["inter_token_latency_seconds"]) == 12
    assert recorder.observed["inter_token_latency_seconds"] == pytest.approx([0.01] * 12)
    assert sorted(recorder.observed["time_to_first_token_seconds"]) == pytest.approx([0.01, 0.01, 0.06])
    assert sorted(recorder.observed["request_queue_time_seconds"]) == pytest.approx([0.0, 0.0, 0.05])
    assert len(recorder.observed["e2e_request_latency_seconds"]) == 3
    assert recorder.total("requests_finished_total", finished_reason="length") == 3
    assert recorder.total("requests_finished_total", finished_reason="rejected") == 1
    assert (
        recorder.total("slo_requests_total", slo="met") == 2 and recorder.total("slo_requests_total", slo="missed") == 2
    )
    assert recorder.total("slo_tokens_total", slo="met") == 10 and recorder.total("slo_tokens_total", slo="missed") == 5
    steps = recorder.total("steps_total")
    assert steps == exporter.totals["steps"] and recorder.total("step_live_slots_total") / steps > 1
    assert recorder.total("slots_total", replica="r0") == 2 and recorder.total("num_requests_running") == 0
    assert exporter.snapshot()["generation_tokens"] == 15


def test_router_exporter_counts_dispatches_and_rejections():
    router = Router(["a", "b"], "round_robin", clock=FakeClock())
    exporter = RouterExporter(router)
    exporter.series = recorder = _Recorder()
    for i in range(4):
        exporter.route(router.route, RouteRequest(f"q{i}", 4, 4))
    with pytest.raises(Exception, match="already in flight"):
        exporter.route(router.route, RouteRequest("q0", 4, 4))
    assert recorder.total("router_dispatches_total", replica="a", routing_policy="round_robin") == 2
    assert recorder.total("router_rejections_total", routing_policy="round_robin") == 1
    assert len(recorder.observed["router_decision_time_seconds"]) == 4


class _Grafana(BaseHTTPRequestHandler):
    """The slice of Grafana's HTTP API `dashboard push` uses, as documented: every request is
    checked (method, path, auth header, required JSON fields); anything else is a 404 noted
    in `errors`."""

    token = "tok"
    datasources: dict[str, dict] = {}
    dashboards: dict[str, dict] = {}
    calls: list[tuple[str, str]] = []
    errors: list[str] = []

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization", "")
        basic = "Basic " + base64.b64encode(b"admin:secret").decode()
        if auth not in (f"Bearer {self.token}", basic):
            self._reply(401, {"message": "Unauthorized"})
            return False
        return True

    def _json(self, required: tuple[str, ...]) -> dict | None:
        if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
            self.errors.append(f"{self.command} {self.path}: Content-Type {self.headers.get('Content-Type')}")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        missing = [f for f in required if f not in body]
        if missing:
            self.errors.append(f"{self.command} {self.path}: missing {missing}")
            self._reply(400, {"message": f"bad request: missing {missing}"})
            return None
        return body

    def _route(self) -> None:
        self.calls.append((self.command, self.path))
        if not self._authorized():
            return
        uid_path = re.fullmatch(r"/api/datasources/uid/([\w-]+)", self.path)
        if self.command == "GET" and uid_path:
            ds = self.datasources.get(uid_path.group(1))
            self._reply(200, ds) if ds else self._reply(404, {"message": "Data source not found"})
        elif self.command == "POST" and self.path == "/api/datasources":
            if (body := self._json(("name", "type", "access", "url"))) is not None:
                self.datasources[body["uid"]] = {**body, "id": len(self.datasources) + 1}
                self._reply(200, {"datasource": body, "id": 1, "message": "Datasource added", "name": body["name"]})
        elif self.command == "PUT" and uid_path:
            if (body := self._json(("name", "type", "access", "url"))) is not None:
                if uid_path.group(1) not in self.datasources:
                    self._reply(404, {"message": "Data source not found"})
                    return
                self.datasources[uid_path.group(1)] = body
                self._reply(200, {"datasource": body, "id": 1, "message": "Datasource updated", "name": body["name"]})
        elif self.command == "POST" and self.path == "/api/dashboards/db":
            if (body := self._json(("dashboard", "overwrite"))) is not None:
                dashboard = body["dashboard"]
                problems = [f for f in ("title", "uid", "panels") if f not in dashboard]
                if dashboard.get("id") is not None or problems:
                    self.errors.append(f"dashboard without {problems} or with a numeric id")
                version = self.dashboards.get(dashboard["uid"], {}).get("version", 0) + 1
                self.dashboards[dashboard["uid"]] = {**dashboard, "version": version}
                uid = dashboard["uid"]
                self._reply(
                    200,
                    {"id": 1, "uid": uid, "url": f"/d/{uid}/x", "status": "success", "version": version, "slug": "x"},
                )
        else:
            self.errors.append(f"unexpected {self.command} {self.path}")
            self._reply(404, {"message": "Not found"})

    do_GET = do_POST = do_PUT = _route


@pytest.fixture
def grafana():
    _Grafana.datasources, _Grafana.dashboards, _Grafana.calls, _Grafana.errors = {}, {}, [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Grafana)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_dashboard_push_creates_then_updates_through_grafanas_api(grafana, capsys):
    """First push: GET the data source (404), POST it, POST the dashboard; second push: GET
    (200), PUT, POST again (version 2). Every request carries the token and the documented
    fields; the dashboard's data-source variable points at the pushed data source."""
    assert main(["dashboard", "push", "--grafana", grafana, "--token", "tok", "--prometheus", "http://p:9090"]) == 0
    assert "data source created" in capsys.readouterr().out
    first = list(_Grafana.calls)
    assert first == [
        ("GET", "/api/datasources/uid/slotserve-prometheus"),
        ("POST", "/api/datasources"),
        ("POST", "/api/dashboards/db"),
    ]
    result = push(grafana, "tok", "http://p:9090")
    assert result.datasource == "updated" and result.version == 2
    assert _Grafana.calls[3:] == [
        ("GET", "/api/datasources/uid/slotserve-prometheus"),
        ("PUT", "/api/datasources/uid/slotserve-prometheus"),
        ("POST", "/api/dashboards/db"),
    ]
    assert _Grafana.errors == []
    assert _Grafana.datasources["slotserve-prometheus"]["url"] == "http://p:9090"
    pushed = _Grafana.dashboards[build.DASHBOARD_UID]
    assert len(pushed["panels"]) == len(json.loads(build.DASHBOARD_FILE.read_text())["panels"])
    assert pushed["templating"]["list"][0]["current"]["value"] == "slotserve-prometheus"
    basic = grafana.replace("http://", "http://admin:secret@")  # basic auth from the URL
    assert push(basic).datasource == "updated"


def test_dashboard_push_and_render_fail_clearly(grafana, capsys):
    with pytest.raises(GrafanaPushError, match="Unauthorized"):
        push(grafana, "wrong")
    assert main(["dashboard", "render", "--prometheus", "http://127.0.0.1:9", "--out", "/tmp/x"]) == 2
    assert "cannot reach Prometheus at http://127.0.0.1:9" in capsys.readouterr().err


def _run_engine(exporter: ReplicaExporter, engine: Engine, after_step=None) -> None:
    """The serving loop's order of hooks: finishes, the step, its load report; once idle, one more report."""
    while engine.has_unfinished:
        result = engine.step()
        for output in result.outputs:
            if output.finished:
                exporter.on_finish(output)
        exporter.on_step(result.record)
        exporter.on_load(engine.load_report("r0"))
        if after_step is not None:
            after_step(result.record)
    exporter.on_load(engine.load_report("r0"))


def test_slot_gauges_after_a_step_show_the_slots_it_held():
    """Six one-token requests on 2 slots: each ends in the step that prefills it, so between
    steps no request holds a slot, yet every step ran 2; the gauges read the step's 2 (what
    occupancy counts), and 0 once the replica is idle."""
    clock = FakeClock()
    engine = Engine(EngineConfig(num_slots=2, max_seq_len=64), ScriptedFakeRunner(clock, FlatCostModel(0.01)), clock)
    exporter = ReplicaExporter("r0", engine, model="fake", slo=SLO(), refresh=None)
    exporter.series = recorder = _Recorder()
    for i in range(6):
        exporter.on_submit(engine.add_request([1, 2, i], {"max_tokens": 1, "ignore_eos": True}, f"q{i}"))
    seen = []

    def check(record) -> None:
        seen.append((engine.load_report("r0").running, recorder.total("num_requests_running")))
        assert recorder.total("slots_used") == record.live_slots == 2

    _run_engine(exporter, engine, check)
    assert seen == [(0, 2)] * 3
    assert recorder.total("num_requests_running") == 0 and recorder.total("slots_used") == 0


def test_capacity_probe_requests_are_counted_under_the_probe_run():
    """While probe requests (ids `probe-...`) run, the replica's counters and latencies and the
    router's dispatches carry run="probe"; the run set before and after is untouched by them."""
    from metrics.live import PROBE_REQUEST_PREFIX, PROBE_RUN

    clock = FakeClock()
    engine = Engine(EngineConfig(num_slots=2, max_seq_len=64), ScriptedFakeRunner(clock, FlatCostModel(0.01)), clock)
    exporter = ReplicaExporter("r0", engine, model="fake", slo=SLO(), refresh=None)
    exporter.series = recorder = _Recorder()
    exporter.set_run(7)
    for i in range(3):
        rid = f"{PROBE_REQUEST_PREFIX}{i}"
        exporter.on_submit(engine.add_request([1, 2, i], {"max_tokens": 4, "ignore_eos": True}, rid))
    _run_engine(exporter, engine)
    exporter.on_submit(engine.add_request([5, 6], {"max_tokens": 3, "ignore_eos": True}, "real"))
    _run_engine(exporter, engine)
    assert recorder.total("generation_tokens_total", run=PROBE_RUN) == 12
    assert recorder.total("generation_tokens_total", run="7") == 3
    assert recorder.total("requests_finished_total", run=PROBE_RUN) == 3
    assert recorder.total("requests_finished_total", run="7") == 1

    router = Router(["a", "b"], "round_robin", clock=FakeClock())
    routed = RouterExporter(router)
    routed.series = decisions = _Recorder()
    routed.set_run(7)
    routed.route(router.route, RouteRequest(f"{PROBE_REQUEST_PREFIX}x", 4, 4))
    routed.route(router.route, RouteRequest("y", 4, 4))
    assert decisions.total("router_dispatches_total", run=PROBE_RUN) == 1
    assert decisions.total("router_dispatches_total", run="7") == 1


def test_occupancy_figure_draws_every_run_it_is_given():
    """An experiment of 14 rows gets 14 occupancy panels, in order (none left out of the figure)."""
    from metrics.plots import occupancy_figure

    steps = [{"replica_id": "replica-0", "start": float(t), "live_slots": t % 3, "num_slots": 2} for t in range(5)]
    names = [f"policy-{i} load 0.9 (run {i})" for i in range(14)]
    fig = occupancy_figure({name: steps for name in names}, "sweep")
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == names


def test_rendered_panels_share_the_range_and_label_ticks_apart():
    """Two panels with data over different parts of the range both span all of it; a share of
    49.9% to 50.1% is drawn on 0-100% with distinct tick labels; a decision time of tens of
    microseconds is labelled in µs (not "0 ms"); a bar gauge at 0 still shows its value."""
    import matplotlib.pyplot as plt

    from dashboards.prometheus import Series
    from dashboards.render import DrawnPanel, draw

    start, end = 1_000_000.0, 1_000_600.0
    share = DrawnPanel(
        "Dispatch share per replica",
        "timeseries",
        "percentunit",
        [(r, Series({}, [(start + 300 + t, 0.5 + d * (-1) ** t) for t in range(60)])) for r, d in (("a", 1e-3),)],
    )
    decision = DrawnPanel("Decision time", "timeseries", "s", [("p99", Series({}, [(end - 60, 2e-5), (end, 4e-5)]))])
    slots = DrawnPanel("Slots in use now", "bargauge", "percentunit", [("a", Series({}, [(start, 0.0)]))])
    fig, axes = plt.subplots(1, 3)
    for ax, panel in zip(axes, (share, decision, slots)):
        draw(ax, panel, start, end)
    fig.canvas.draw()
    assert axes[0].get_xlim() == axes[1].get_xlim()
    assert axes[0].get_ylim() == (0.0, 1.0)
    share_ticks = [t.get_text() for t in axes[0].get_yticklabels()]
    assert len(set(share_ticks)) == len(share_ticks) > 2
    assert all(t.get_text().endswith("µs") for t in axes[1].get_yticklabels() if t.get_text())
    assert [t.get_text() for t in axes[2].texts] == ["0.0%"]
    plt.close(fig)


def _legend_clear_of_every_axes(fig) -> list[str]:
    """The figure's one legend's labels, after checking that no panel has a legend of its own
    and that the figure's lies outside every visible panel."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert ax.get_legend() is None
        assert not ax.get_visible() or not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
    return [t.get_text() for t in legend.get_texts()]


def test_occupancy_figure_gives_each_replica_one_colour_and_one_legend_outside_the_panels():
    """A replica is drawn in the same colour in every panel, named once in a figure legend that
    covers no panel (a legend per panel covered the lines)."""
    from metrics.plots import occupancy_figure

    steps = [
        {"replica_id": r, "start": float(t), "live_slots": t % 3, "num_slots": 2}
        for r in ("r0", "r1")
        for t in range(5)
    ]
    fig = occupancy_figure({"a": steps, "b": steps, "c": steps, "d": steps}, "sweep")
    assert _legend_clear_of_every_axes(fig) == ["r0", "r1"]
    panels = [[line.get_color() for line in ax.lines] for ax in fig.axes if ax.get_visible()]
    assert all(colors == panels[0] for colors in panels) and len(set(map(str, panels[0]))) == 2


def test_cluster_runs_figure_shows_one_colour_per_policy_and_the_winners_lead(tmp_path):
    """`slotserve run`'s picture of 3 policies x 2 seeds: the goodput panel has one bar per
    policy and a dot per seed, titled with the winner's ratio over the runner-up (analyze's
    goodput); every latency line is drawn in its policy's colour, one line per seed; the one
    legend names each policy once and covers no panel."""
    import statistics

    from metrics.definitions import RequestTrace
    from metrics.goodput_report import analyze, analyze_by_policy
    from metrics.plots import cluster_runs_figure
    from metrics.recording import record_run
    from metrics.store import open_store
    from protocol.records import StepRecord

    store = open_store(tmp_path / "store.db")
    # fast: every request within the 0.5 s TTFT SLO; half: half of them; late: a quarter
    met = {"fast": 1.0, "half": 0.5, "late": 0.25}
    run_ids = []
    for seed in (0, 1):
        for policy, share in met.items():
            traces = []
            for i in range(8):
                ttft = 0.1 + 0.01 * seed if i < share * 8 else 2.0
                times = [i + ttft + 0.01 * k for k in range(4)]
                traces.append(RequestTrace(f"q{i}", float(i), times, times[-1], "length", 8, replica=f"r{i % 2}"))
            steps = [
                (f"r{r}", 4, StepRecord(t, float(t), 0.5, 1, 0, 8, 1 + (t + r) % 3, 1, 1, 0, 0))
                for r in (0, 1)
                for t in range(10)
            ]
            run_ids.append(
                record_run(
                    store,
                    name=f"kv-pressure-{policy}-seed{seed}",
                    config={"workload": "kv-pressure (seed 0): 8 requests", "num_replicas": 2},
                    batching_policy="chunked",
                    routing_policy=policy,
                    seed=seed,
                    traces=traces,
                    steps=steps,
                )
            )
    slo = SLO(0.5, 0.05)
    fig = cluster_runs_figure(store, analyze_by_policy(store, run_ids, slo), slo)
    assert _legend_clear_of_every_axes(fig) == list(met)
    ax_goodput, ax_occupancy, ax_ttft, ax_itl = fig.axes
    assert len(ax_goodput.patches) == 3 and [t.get_text() for t in ax_goodput.get_xticklabels()] == list(met)
    assert sum(len(c.get_offsets()) for c in ax_goodput.collections if c.get_offsets().shape[1] == 2) >= 6
    goodput = {
        p: statistics.median(analyze(store, r, slo)["cluster"]["goodput"] for r in run_ids[i::3])
        for i, p in enumerate(met)
    }
    assert goodput["fast"] > goodput["half"] > goodput["late"]
    ratio = goodput["fast"] / goodput["half"]
    assert ax_goodput.get_title().startswith(f"fast {ratio:.2f}x half's goodput (holds over 2 seeds")
    legend_colors = [tuple(h.get_color()) for h in fig.legends[0].legend_handles]
    for ax in (ax_ttft, ax_itl):
        lines = [tuple(line.get_color()) for line in ax.lines if line.get_label() != "TTFT SLO"]
        assert sorted(set(lines)) == sorted(legend_colors) and len(lines) == len(run_ids)
    assert [tuple(line.get_color()) for line in ax_occupancy.lines] == legend_colors
    assert "kv-pressure, 2 replicas" in fig.get_suptitle() and "TTFT <= 0.5 s" in fig.get_suptitle()
