"""`slotserve experiment FILE [--simulate]`: experiment files (workloads/experiment.py), the
runner (cluster/experiment.py) and its table and report (cluster/experiment_report.py). The
simulated runs take seconds; one test runs two cells on a real local Ray cluster of fake
replicas; bad files must fail with file and line before the store is touched."""

from __future__ import annotations

import sqlite3
import textwrap

import pytest

from cli.main import main
from experiments.plan import plan_experiment
from experiments.run import run_experiment
from metrics.plots import slot_spans
from metrics.store import MetricsStore, open_store
from workloads.experiment import ExperimentError
from workloads.prefixes import best_prefix_hit_rate

EXPERIMENT = """\
name = "tiny"
description = "two batching policies, two loads, two seeds"

[workload]
standard = "bursty-mix"
args = { num_requests = 12 }

[cluster]
replicas = 2
slots = 4
max_seq_len = 256
model = "fake"
fake_step_seconds = 0.01

[sweep]
batching = ["static", "continuous"]
routing = ["least_loaded"]
load = [0.5, 1.0]
seeds = [0, 1]

[slo]
ttft = 1.0
tpot = 0.05
"""
PLOTS = ("throughput", "latency", "cdf", "occupancy", "slot_timeline")


def write(tmp_path, text: str, name: str = "tiny.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def line_of(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if fragment in line)


def test_simulated_experiment_records_a_run_per_cell_and_reports(tmp_path, capsys):
    """--dry-run lists the 8 cells and writes nothing; --simulate then records one complete
    simulated run per cell (config naming experiment, file and cell; load 1.0 offers twice the
    rate of 0.5), prints one row per cell without its seed, and writes report.md and every
    plot; each derived slot timeline fits its replica's slots with no lane used twice at once."""
    path, store_path = write(tmp_path, EXPERIMENT), tmp_path / "store.db"
    assert main(["experiment", str(path), "--simulate", "--store", str(store_path), "--dry-run"]) == 0
    assert "8 cells (4 rows x 2 seeds)" in capsys.readouterr().out and not store_path.exists()

    assert main(["experiment", str(path), "--simulate", "--store", str(store_path)]) == 0
    out = capsys.readouterr().out
    store = MetricsStore(store_path)
    runs = store.runs()
    assert len(runs) == 8 and all(r["simulated"] and r["status"] == "complete" for r in runs)
    assert {(r["config"]["cell"]["batching"], r["config"]["cell"]["load"], r["seed"]) for r in runs} == {
        (b, load, s) for b in ("static", "continuous") for load in (0.5, 1.0) for s in (0, 1)
    }
    assert all(r["config"]["experiment"] == "tiny" and r["config"]["experiment_file"] == str(path) for r in runs)
    rate = {
        (r["config"]["cell"]["load"], r["seed"]): r["config"]["workload_params"]["mean_rate_requests_per_s"]
        for r in runs
        if r["batching_policy"] == "static"
    }
    assert rate[(1.0, 0)] == pytest.approx(2 * rate[(0.5, 0)])
    assert all(len(store.requests(r["run_id"])) == 12 for r in runs)

    table = [line for line in out.splitlines() if line.startswith(("static", "continuous"))]
    assert len(table) == 4 and all("±" in line for line in table)
    assert "median over seeds ± half the min–max range (2 seeds)" in out

    report_dir = tmp_path / "tiny"
    report = (report_dir / "report.md").read_text()
    assert f"slotserve experiment {path} --simulate --store {store_path}" in report
    assert report.count("| static | least_loaded |") == 2 and "TTFT <= 1.0 s, TPOT <= 0.05 s" in report
    for name in PLOTS:
        assert (report_dir / f"{name}.png").stat().st_size > 10_000 and f"]({name}.png)" in report

    for run in runs:
        steps = [s for s in store.steps(run["run_id"]) if s["replica_id"] == "r0"]
        spans = slot_spans([t for t in store.traces(run["run_id"]) if t.replica == "r0"], steps)
        assert spans and max(s.lane for s in spans) < 4
        for lane in range(4):
            mine = sorted((s.start, s.last_token) for s in spans if s.lane == lane)
            assert all(end <= next_start + 1e-9 for (_, end), (next_start, _) in zip(mine, mine[1:]))


def test_token_budget_axis_multiplies_only_policies_that_read_it(tmp_path):
    """Only `chunked` reads the token budget: a [32, 64] budget axis gives it two cells and
    the other policies one (no identical repeated runs); --seeds replaces the file's seeds."""
    text = EXPERIMENT.replace("load = [0.5, 1.0]", "token_budget = [32, 64]").replace(
        '["static", "continuous"]', '["static", "chunked"]'
    )
    plan = plan_experiment(write(tmp_path, text), seeds=[7])
    assert [(c.batching, c.token_budget, c.seed) for c in plan.cells] == [
        ("static", None, 7),
        ("chunked", 32, 7),
        ("chunked", 64, 7),
    ]
    assert [plan.engine_config(c).token_budget for c in plan.cells[1:]] == [32, 64]


def test_loads_override_replaces_the_files_load_axis_and_is_checked(tmp_path):
    """--loads reruns chosen loads of a file (as --seeds does seeds): the cells take the given
    loads only, and a load the file could not hold is refused the same way."""
    path = write(tmp_path, EXPERIMENT)
    plan = plan_experiment(path, seeds=[0], loads=[0.8])
    assert {c.load for c in plan.cells} == {0.8}
    assert len(plan.cells) == len(plan_experiment(path, seeds=[0]).cells) // 2
    with pytest.raises(ExperimentError, match="sweep.load"):
        plan_experiment(path, loads=[-1.0])


def test_workload_axis_sweeps_the_standard_workloads_arguments(tmp_path):
    """sweep.workload gives one cell per argument set, each built from the standard workload
    with that argument (sigma-sweep's output spread here), shown as its own table column; an
    argument the workload does not take is an error at that key's line."""
    text = EXPERIMENT.replace(
        'standard = "bursty-mix"\nargs = { num_requests = 12 }',
        'standard = "sigma-sweep"\nargs = { num_requests = 12 }',
    ).replace("load = [0.5, 1.0]", "workload = [{ sigma = 0.0 }, { sigma = 1.2 }]")
    plan = plan_experiment(write(tmp_path, text), seeds=[0])
    assert [(c.workload, c.batching) for c in plan.cells] == [
        ("sigma=0.0", "static"),
        ("sigma=0.0", "continuous"),
        ("sigma=1.2", "static"),
        ("sigma=1.2", "continuous"),
    ]
    flat, spread = (plan.workload(c, 1.0).output_lens for c in (plan.cells[0], plan.cells[2]))
    assert len(set(flat)) == 1 and len(set(spread)) > 5

    bad = text.replace("{ sigma = 1.2 }", "{ sigmaa = 1.2 }")
    with pytest.raises(ValueError, match=rf"tiny.toml:{line_of(bad, 'sigmaa')}: sweep.workload: .*sigmaa"):
        plan_experiment(write(tmp_path, bad))


def test_the_help_example_is_a_valid_experiment(tmp_path):
    """The file shown by `slotserve experiment --help` plans as it says: 2 batching policies
    (chunked with 2 budgets) x 3 loads x 3 seeds."""
    from cli.experiment import EXAMPLE

    body = EXAMPLE.split("\n", 1)[1].split("\nPaths")[0]
    plan = plan_experiment(write(tmp_path, "\n".join(line[2:] for line in body.splitlines())))
    assert len(plan.cells) == 27 and {c.batching for c in plan.cells} == {"continuous", "chunked"}


@pytest.mark.parametrize("interrupt, status", [(KeyboardInterrupt, "aborted"), (RuntimeError, "failed")])
def test_a_cell_cut_short_is_ended_not_left_running(tmp_path, monkeypatch, interrupt, status):
    """A Ctrl-C or an error while a cell's run is being written ends that run 'aborted' or
    'failed'; the runs before it stay complete and nothing is left 'running'."""
    plan = plan_experiment(write(tmp_path, EXPERIMENT), simulate=True)
    writes = {"n": 0}
    add_steps = MetricsStore.add_steps

    def flaky(self, run_id, rows):
        writes["n"] += 1
        if writes["n"] == 3:
            raise interrupt("cut short")
        add_steps(self, run_id, rows)

    monkeypatch.setattr(MetricsStore, "add_steps", flaky)
    with pytest.raises(interrupt):
        run_experiment(plan, simulate=True, store_path=tmp_path / "s.db", progress=False)
    assert [r["status"] for r in MetricsStore(tmp_path / "s.db").runs()] == ["complete", "complete", status]


TRACE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
TRACES = {
    "missing-column": ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n", "bad.csv:1: missing column"),
    "negative-length": (
        TRACE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.0,-3,5\n",
        "bad.csv:3: negative length",
    ),
    "time-goes-back": (
        TRACE_HEADER + "2023-11-16 18:15:47.0,374,44\n2023-11-16 18:15:46.0,10,5\n",
        "bad.csv:3: timestamp goes back",
    ),
}
TRACE_WORKLOAD = '[workload]\nspec = { source = "trace", format = "azure", path = "bad.csv", limit = 10 }'
BAD = {  # name: (edit of the file, the line the error must name (a fragment of it), words of the message)
    "unknown-batching": (
        ('"static", "continuous"', '"static", "statik"'),
        "batching =",
        "sweep.batching: unknown batching policy 'statik'; choose one of static",
    ),
    "unknown-routing": (('["least_loaded"]', '["fastest"]'), "routing =", "sweep.routing: unknown routing policy"),
    "missing-model": (('model = "fake"\n', ""), "[cluster]", "cluster.model: required key missing"),
    "unknown-key": (
        ("replicas = 2", "replicas = 2\nreplica_count = 3"),
        "replica_count",
        "cluster.replica_count: unknown key",
    ),
    "negative-load": (("load = [0.5, 1.0]", "load = [0.5, -1.0]"), "load =", "sweep.load[1]: Input should be greater"),
    "toml-syntax": (("replicas = 2", "replicas = = 2"), "replicas =", "TOML syntax: Invalid value"),
    "load-without-rate": (('"bursty-mix"', '"saturated"'), "load =", "has no arrival rate"),
    "bad-factory-arg": (("num_requests = 12", "num_requests = 12, rat = 3"), "args =", "unexpected keyword argument"),
}


@pytest.mark.parametrize("case", list(BAD) + [f"trace-{t}" for t in TRACES] + ["yaml-unknown-policy"])
def test_bad_files_name_file_and_line_and_leave_the_store_alone(tmp_path, capsys, case):
    """Every bad file fails at load time with exit 2 and one line `FILE:LINE: key: what`
    (a bad trace also names the trace's own file and line), and the store keeps exactly the
    runs it had."""
    store_path = tmp_path / "store.db"
    store = open_store(store_path)
    store.end_run(store.begin_run("earlier", {}, "continuous", "least_loaded", 0))
    store.close()
    if case.startswith("trace-"):
        csv, words = TRACES[case.removeprefix("trace-")]
        (tmp_path / "bad.csv").write_text(csv)
        text = EXPERIMENT.replace('[workload]\nstandard = "bursty-mix"\nargs = { num_requests = 12 }', TRACE_WORKLOAD)
        path, line = write(tmp_path, text), line_of(text, "spec = ")
    elif case == "yaml-unknown-policy":
        text = (
            "name: tiny\nworkload:\n  standard: saturated\n  args: {num_requests: 8}\n"
            "cluster:\n  model: fake\n  fake_step_seconds: 0.01\nsweep:\n  batching:\n    - static\n    - statik\n"
        )
        path, line, words = write(tmp_path, text, "tiny.yaml"), 9, "sweep.batching: unknown batching policy 'statik'"
    else:
        (old, new), fragment, words = BAD[case]
        assert old in EXPERIMENT
        text = EXPERIMENT.replace(old, new)
        path, line = write(tmp_path, text), line_of(text, fragment)

    assert main(["experiment", str(path), "--simulate", "--store", str(store_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"slotserve: error: {path}:{line}: ") and words in err
    with sqlite3.connect(store_path) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 1


@pytest.mark.parametrize("where", ["../outside.csv", "ABSOLUTE"])
def test_paths_may_not_leave_the_files_folder_unless_allowed(tmp_path, capsys, where):
    """A trace named by `..` or an absolute path outside the experiment file's folder is refused
    with the file, line and key (nothing is read); `--allow-outside-paths` lets it through."""
    inner = tmp_path / "exp"
    inner.mkdir()
    trace = tmp_path / "outside.csv"
    trace.write_text(TRACE_HEADER + "2023-11-16 18:15:46.0,30,4\n2023-11-16 18:15:47.0,20,5\n")
    path_text = str(trace) if where == "ABSOLUTE" else where
    text = EXPERIMENT.replace(
        '[workload]\nstandard = "bursty-mix"\nargs = { num_requests = 12 }',
        f'[workload]\nspec = {{ source = "trace", format = "azure", path = "{path_text}", limit = 2 }}',
    ).replace("load = [0.5, 1.0]\n", "")
    path = write(inner, text)
    assert main(["experiment", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert (
        f"{path}:{line_of(text, 'spec = ')}: workload.spec.path" in err and "leaves the experiment file's folder" in err
    )
    assert main(["experiment", str(path), "--dry-run", "--allow-outside-paths"]) == 0


@pytest.fixture
def local_ray():
    import ray

    from cluster.deploy import stop_cluster

    ray.init(address="local", num_cpus=4, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    yield
    if ray.is_initialized():
        stop_cluster()
        ray.shutdown()


def test_real_cluster_of_fake_replicas_records_real_runs(tmp_path, capsys, local_ray):
    """The same kind of file without --simulate: two cells (two batching policies, so the
    replicas are restarted between them) of 20 requests on a local Ray cluster of fake
    replicas, recorded as real, complete runs with every request and both replicas' steps."""
    text = (
        EXPERIMENT.replace("num_requests = 12", "num_requests = 20")
        .replace("load = [0.5, 1.0]", "load = [0.8]")
        .replace("seeds = [0, 1]", "seeds = [3]")
        .replace('["static", "continuous"]', '["mixed", "continuous"]')
    )
    path, store_path = write(tmp_path, text), tmp_path / "store.db"
    assert main(["experiment", str(path), "--store", str(store_path), "--out", str(tmp_path / "out")]) == 0
    runs = MetricsStore(store_path).runs()
    assert [(r["batching_policy"], r["simulated"], r["status"], r["seed"]) for r in runs] == [
        ("mixed", False, "complete", 3),
        ("continuous", False, "complete", 3),
    ]
    store = MetricsStore(store_path)
    for run in runs:
        assert len(store.requests(run["run_id"])) == 20
        assert {s["replica_id"] for s in store.steps(run["run_id"])} == {"replica-0", "replica-1"}
        assert run["config"]["capacity_tokens_per_s"] > 0
    assert (tmp_path / "out" / "report.md").exists() and "mixed" in capsys.readouterr().out


COST_MODEL = '{"c0": 0.004, "c_decode": 0.0005, "c_prefill": 0.00005, "c_ctx": 0.0, "c_held": 0.0}'


def test_ray_serve_routers_run_beside_slotserve_in_one_file(tmp_path, capsys, local_ray):
    """Ray Serve's default router is one more value of sweep.routing: on a cluster its cell runs
    the same replica engine (fake, each step priced by a cost model file, prefix caching on) as
    a Ray Serve application and is recorded in the same store with its steps, and the output
    compares slotserve's best policy with it. The capacity that sets the load is measured with
    prompts the prefix cache has not seen. --simulate leaves Serve's cells out and says so."""
    (tmp_path / "cost.json").write_text(COST_MODEL)
    text = (
        EXPERIMENT.replace("num_requests = 12", "num_requests = 16")
        .replace("fake_step_seconds = 0.01", 'cost_model = "cost.json"\ncost_scale = 2.0')
        .replace("max_seq_len = 256", 'max_seq_len = 256\nengine = { kv_cache = "paged", prefix_caching = true }')
        .replace('["static", "continuous"]', '["continuous"]')
        .replace('["least_loaded"]', '["least_work", "serve_power_of_two"]')
        .replace("load = [0.5, 1.0]", "load = [0.8]")
        .replace("seeds = [0, 1]", "seeds = [0]")
    )
    path, store_path = write(tmp_path, text), tmp_path / "store.db"
    assert main(["experiment", str(path), "--store", str(store_path), "--out", str(tmp_path / "out")]) == 0
    store = MetricsStore(store_path)
    runs = store.runs()
    assert [(r["routing_policy"], r["status"]) for r in runs] == [
        ("least_work", "complete"),
        ("serve_power_of_two", "complete"),
    ]
    for run in runs:
        assert len(store.requests(run["run_id"])) == 16
        assert sum(s["num_prefill_tokens"] for s in store.steps(run["run_id"])) > 0
        # each prefill probe's prompts are new to the prefix cache: the rate is what computing
        # them costs (at most 1 / c_prefill per replica), not the rate of cache hits
        assert 0 < run["config"]["capacity_prefill_tokens_per_s"] < 2 / (0.00005 * 2.0)
    serve_steps = store.steps(runs[1]["run_id"])
    assert {s["replica_id"][:6] for s in serve_steps} == {"serve-"} and len({s["replica_id"] for s in serve_steps}) == 2
    out = capsys.readouterr().out
    assert "best slotserve least_work" in out and "x serve_power_of_two (" in out
    assert "## Against Ray Serve's routers" in (tmp_path / "out" / "report.md").read_text()

    assert main(["experiment", str(path), "--simulate", "--store", str(tmp_path / "sim.db")]) == 0
    out = capsys.readouterr().out
    assert "1 cells routed by Ray Serve's routers left out" in out
    assert [r["routing_policy"] for r in MetricsStore(tmp_path / "sim.db").runs()] == ["least_work"]


def test_prefix_hit_rates_are_set_against_the_best_possible(tmp_path, capsys):
    """On a workload whose prompts share blocks, with prefix caching on, the output and the
    report set each policy's prefix hit rate against the best possible one (every request
    where its longest cached prefix lives): the ceiling is the workload's own, no measured
    rate exceeds it by more than rounding, and the cache-blind policy stays below the
    prefix-aware one. A workload without shared blocks gets no such line."""
    text = (
        EXPERIMENT.replace('standard = "bursty-mix"', 'standard = "shared-prefix"')
        .replace("num_requests = 12", "num_requests = 48")
        .replace("max_seq_len = 256", 'max_seq_len = 512\nengine = { kv_cache = "paged", prefix_caching = true }')
        .replace('["static", "continuous"]', '["continuous"]')
        .replace('["least_loaded"]', '["round_robin", "prefix_affinity"]')
        .replace("load = [0.5, 1.0]", "load = [0.6]")
        .replace("seeds = [0, 1]", "seeds = [0]")
    )
    path, store_path = write(tmp_path, text), tmp_path / "store.db"
    assert main(["experiment", str(path), "--simulate", "--store", str(store_path), "--out", str(tmp_path / "o")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "best possible prefix hit" in x)
    plan = plan_experiment(path, simulate=True)
    result = run_experiment(plan, simulate=True, store_path=tmp_path / "again.db", progress=False)
    workload = plan.workload(plan.cells[0], result.capacities[4])
    best = best_prefix_hit_rate(workload, 0, result.vocab_size, 16)
    assert 0.3 < best < 1 and f"best possible prefix hit {100 * best:.1f}%" in line
    parts = [part.split(" ", 1) for part in line.split("; ")[1].split(", ")]
    rates = {policy: float(rest.split("%")[0]) / 100 for policy, rest in parts}
    assert set(rates) == {"round_robin", "prefix_affinity"}
    assert all(r <= best + 0.01 for r in rates.values()) and rates["round_robin"] < rates["prefix_affinity"]
    assert line.split(": ", 1)[1] in (tmp_path / "o" / "report.md").read_text()

    plain = text.replace('standard = "shared-prefix"', 'standard = "bursty-mix"')
    path = write(tmp_path, plain, "plain.toml")
    assert main(["experiment", str(path), "--simulate", "--store", str(tmp_path / "p.db"), "--out", str(tmp_path)]) == 0
    assert "best possible prefix hit" not in capsys.readouterr().out
