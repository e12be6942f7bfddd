"""The metrics store (cluster/store.py), its Ray actor and the goodput report (cluster/report.py)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli.report import add_parser as add_report_command
from metrics.definitions import SLO
from metrics.goodput_report import analyze, format_report
from metrics.recording import decision_row, step_row
from metrics.store import MetricsStore, StoreError, UnknownRunError, open_store
from protocol.records import Decision, StepRecord

REPO = Path(__file__).resolve().parents[1]


def request(
    rid: str,
    replica: str | None,
    arrival: float,
    n_tokens: int,
    finish: str = "length",
    ttft: float = 0.5,
    gap: float = 0.1,
    **extra,
) -> dict:
    """A final request row whose tokens start `ttft` after arrival and come `gap` apart."""
    times = [arrival + ttft + k * gap for k in range(n_tokens)]
    return {
        "request_id": rid,
        "replica_id": replica,
        "arrival": arrival,
        "completion": times[-1] if times else arrival,
        "finish_reason": finish,
        "prompt_len": 8,
        "token_times": times,
        **extra,
    }


def step(replica: str, n: int, live: int, useful: int, computed: int, slots: int = 4, preemptions: int = 0) -> dict:
    record = StepRecord(
        step=n,
        start=float(n),
        duration=0.01,
        num_decode_tokens=live,
        num_prefill_tokens=0,
        context_tokens=live,
        live_slots=live,
        useful_rows=useful,
        computed_rows=computed,
        num_preemptions=preemptions,
        queue_depth=0,
    )
    return step_row(replica, record, slots)


def decision(rid: str, replica: str, scores: dict[str, float], signal_age: float | None = None) -> dict:
    in_flight = dict.fromkeys(scores, 0)
    return decision_row(Decision(rid, replica, 0.0, "least_loaded", scores, signal_age, in_flight))


@pytest.fixture
def store(tmp_path) -> MetricsStore:
    return open_store(tmp_path / "results" / "slotserve.db")


@pytest.fixture
def mixed_run(store) -> int:
    """Replica a: 3 requests (one failed after 2 tokens), b: 1, and one rejected before routing."""
    run = store.begin_run("mixed", {"replicas": 2}, "continuous", "least-loaded", 7, slo={"ttft": 2.0})
    store.add_requests(
        run,
        [
            request("r1", "a", 0.0, 4, num_preemptions=1),
            request("r2", "a", 1.0, 4, finish="eos"),
            request("r3", "a", 2.0, 2, finish="error", error="step failed"),
            request("r4", "b", 0.5, 6),
            request("r5", None, 3.0, 0, finish="rejected", error="queue full"),
        ],
    )
    store.add_steps(run, [step("a", 0, 2, 2, 2), step("a", 1, 4, 3, 4, preemptions=2), step("b", 0, 1, 1, 1)])
    store.add_decisions(run, [decision("r1", "a", {"a": 0, "b": 1}, signal_age=0.02)])
    store.end_run(run)
    return run


def test_schema_round_trip(store, mixed_run):
    """What is written reads back unchanged: run metadata (JSON fields decoded, code version and
    machine filled in), token times in order, first_token/output_len derived from them, steps,
    and decisions with their JSON scores."""
    run = store.run(mixed_run)
    assert run["name"] == "mixed" and run["config"] == {"replicas": 2} and run["slo"] == {"ttft": 2.0}
    assert (run["batching_policy"], run["routing_policy"], run["seed"]) == ("continuous", "least-loaded", 7)
    assert run["status"] == "complete" and run["complete"] and run["ended"] >= run["started"]
    assert run["simulated"] is False and run["git_commit"] and run["machine"]["cpu_count"] == os.cpu_count()
    traces = {t.request_id: t for t in store.traces(mixed_run)}
    assert traces["r4"].token_times == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4, 1.5])
    assert traces["r1"].replica == "a" and traces["r1"].num_preemptions == 1 and traces["r5"].replica is None
    rows = {r["request_id"]: r for r in store.requests(mixed_run)}
    assert rows["r4"]["first_token"] == pytest.approx(1.0) and rows["r4"]["output_len"] == 6
    assert rows["r5"]["first_token"] is None and rows["r5"]["error"] == "queue full"
    assert [(s["replica_id"], s["step"], s["computed_rows"]) for s in store.steps(mixed_run)] == [
        ("a", 0, 2),
        ("a", 1, 4),
        ("b", 0, 1),
    ]
    (decision,) = store.decisions(mixed_run)
    assert decision["scores"] == {"a": 0, "b": 1} and decision["signal_age"] == 0.02


def test_a_store_of_the_previous_schema_is_migrated_in_place(tmp_path):
    """A store of schema 3 (four step columns named apart from StepRecord's fields) opens: its
    rows read under the record's names, and new steps are written beside them."""
    import sqlite3

    from metrics.store import SCHEMA_VERSION

    path = tmp_path / "old.db"
    open_store(path).close()
    conn = sqlite3.connect(path)
    for old in ("time", "decode_tokens", "prefill_tokens", "preemptions"):  # schema 3's names
        new = {"time": "start"}.get(old, f"num_{old}")
        conn.execute(f"ALTER TABLE steps RENAME COLUMN {new} TO {old}")
    for table, column in (
        ("decisions", "predicted_ttft"),
        ("decisions", "believed_cached"),
        ("requests", "cached_tokens"),
        ("migrations", "kv_bytes"),
        ("migrations", "kv_seconds"),
        ("requests", "priority"),
        ("requests", "tenant"),
    ):
        conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")  # added in schemas 6, 7 and 8
    conn.execute(
        "INSERT INTO runs (name, started, status, batching_policy, routing_policy, seed, simulated) "
        "VALUES ('old', 0, 'complete', 'continuous', 'round_robin', 0, 0)"
    )
    # run, replica, slots, step, time, duration, decode, prefill, context, live, useful, computed, preemptions, queue
    conn.execute("INSERT INTO steps VALUES (1, 'a', 4, 0, 2.5, 0.1, 3, 0, 3, 1, 1, 1, 2, 0)")
    conn.execute("PRAGMA user_version=3")
    conn.commit()
    conn.close()
    store = open_store(path)
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    [old] = store.steps(1)
    assert (old["start"], old["num_decode_tokens"], old["num_preemptions"]) == (2.5, 3, 2)
    store.add_steps(1, [step("a", 1, 2, 2, 2)])
    assert [s["step"] for s in store.steps(1)] == [0, 1]
    store.close()
    assert len(open_store(path).steps(1)) == 2  # opening a migrated store again is a no-op


def test_json_columns_take_dicts_or_json_text(store):
    """A JSON column given its text (as the router sends scores) is stored once, not encoded
    twice, so it reads back as the same dict; text that is not a JSON object is refused."""
    run = store.begin_run("json", {}, "continuous", "round-robin", 0)
    row = {**decision("r1", "a", {"a": 0.0}), "scores": json.dumps({"a": None, "b": 2.0}), "in_flight": {"a": 1}}
    store.add_decisions(run, [row])
    assert store.decisions(run)[0]["scores"] == {"a": None, "b": 2.0}
    with pytest.raises(StoreError, match="column 'scores' takes a dict"):
        store.add_decisions(run, [{**decision("r2", "a", {}), "scores": "a=1"}])


def test_bad_batch_is_named_and_written_not_at_all(store):
    """An unknown column is an error naming it, and a batch that fails part-way (a duplicate
    request id) leaves none of its rows, requests or tokens, behind."""
    run = store.begin_run("bad", {}, "continuous", "round-robin", 0)
    with pytest.raises(StoreError, match="unknown column 'replica'"):
        store.add_requests(run, [request("r1", "a", 0.0, 3), {"request_id": "r2", "replica": "a"}])
    store.add_requests(run, [request("r1", "a", 0.0, 3)])
    with pytest.raises(StoreError, match="not written"):
        store.add_requests(run, [request("r2", "a", 0.0, 5), request("r1", "a", 0.0, 3)])
    assert [t.request_id for t in store.traces(run)] == ["r1"]
    assert store.conn.execute("SELECT COUNT(*) FROM tokens").fetchone()[0] == 3


def test_many_runs_in_one_file(tmp_path):
    """Runs share one file and stay apart: a new connection lists both with their policies,
    and each run's traces hold only its own requests."""
    path = tmp_path / "s.db"
    first = open_store(path)
    r1 = first.begin_run("one", {}, "static", "round-robin", 0)
    first.add_requests(r1, [request("x", "a", 0.0, 2)])
    first.end_run(r1)
    r2 = first.begin_run("two", {}, "continuous", "least-loaded", 1)
    first.add_requests(r2, [request("x", "b", 0.0, 5), request("y", "b", 0.0, 1)])
    first.end_run(r2)
    first.close()
    again = MetricsStore(path)
    assert [(r["run_id"], r["batching_policy"], r["routing_policy"]) for r in again.runs()] == [
        (r1, "static", "round-robin"),
        (r2, "continuous", "least-loaded"),
    ]
    assert [t.num_output_tokens for t in again.traces(r1)] == [2]
    assert sorted(t.num_output_tokens for t in again.traces(r2)) == [1, 5]


def test_run_never_ended_reads_incomplete(tmp_path):
    """A run without end_run keeps status 'running' and reads as not complete, and the report
    says INCOMPLETE while still analysing what was stored."""
    path = tmp_path / "s.db"
    writer = open_store(path)
    run = writer.begin_run("open", {}, "continuous", "round-robin", 0)
    writer.add_requests(run, [request("r1", "a", 0.0, 3)])
    reader = MetricsStore(path)
    assert reader.run(run)["status"] == "running" and reader.run(run)["complete"] is False
    analysis = analyze(reader, run)
    assert analysis["complete"] is False and analysis["cluster"]["num_requests"] == 1
    assert "INCOMPLETE (still running, or stopped before end_run" in format_report([analysis])


_KILLED_WRITER = """
import sys
from metrics.store import open_store
store = open_store(sys.argv[1])
run = store.begin_run("killed", {}, "continuous", "round-robin", 0)
print(run, flush=True)
batch = 0
while True:
    store.add_requests(run, [{"request_id": f"{batch}-{i}", "replica_id": "a", "arrival": 0.0, "completion": 9.0,
                              "finish_reason": "length", "token_times": [0.1 * k for k in range(50)]}
                             for i in range(200)])
    batch += 1
    print(batch, flush=True)
"""


def test_writer_killed_mid_batch_leaves_committed_batches(tmp_path):
    """A writer SIGKILLed while writing batches leaves a valid file holding only whole batches
    (requests and their tokens together), and its run reads incomplete."""
    path = tmp_path / "s.db"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        run = int(child.stdout.readline())
        while int(child.stdout.readline() or "0") < 3:  # "" if the child died: fails below
            if child.poll() is not None:
                pytest.fail(f"writer exited early with {child.returncode}")
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    store = MetricsStore(path)
    assert store.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    traces = store.traces(run)
    assert len(traces) >= 600 and len(traces) % 200 == 0
    assert all(t.num_output_tokens == 50 for t in traces)
    assert store.run(run)["complete"] is False and store.run(run)["status"] == "running"


def test_analyze_per_replica_counts_balance_occupancy_efficiency(store, mixed_run):
    """Per-replica counts include every request routed there; imbalance is max/mean (a 3, b 1
    -> 1.5; tokens 10 vs 6 -> 1.25); occupancy is the mean over steps of live/slots and the
    cluster's is the mean over replicas; slot efficiency is useful/computed rows; preemptions
    are summed per replica from the steps."""
    a = analyze(store, mixed_run, SLO(ttft=2.0, tpot=0.25))
    cluster, ra, rb = a["cluster"], a["replicas"]["a"], a["replicas"]["b"]
    assert list(a["replicas"]) == ["a", "b"]
    assert (ra["num_requests"], ra["output_tokens"], rb["num_requests"], rb["output_tokens"]) == (3, 10, 1, 6)
    assert a["imbalance"] == {"requests": pytest.approx(1.5), "output_tokens": pytest.approx(1.25)}
    assert ra["occupancy"] == pytest.approx((2 / 4 + 4 / 4) / 2) and rb["occupancy"] == pytest.approx(0.25)
    assert cluster["occupancy"] == pytest.approx(0.5)  # pooled over steps it would be 0.583
    assert ra["slot_efficiency"] == pytest.approx(5 / 6) and cluster["slot_efficiency"] == pytest.approx(6 / 7)
    assert cluster["num_requests"] == 5 and cluster["output_tokens"] == 16
    assert (cluster["preemptions"], ra["preemptions"], rb["preemptions"]) == (2, 2, 0)  # from the steps
    assert cluster["num_preemptions"] == 1  # from the request rows
    assert a["complete"] and a["slo"] == {"ttft": 2.0, "tpot": 0.25, "e2e": None}


def test_rejected_and_failed_are_counted_and_miss_the_slo(store, mixed_run):
    """'rejected' and 'error' ends are counted where they happened and never count as good:
    attainment is 3 of 5, and goodput counts only the tokens of the 3 good requests."""
    a = analyze(store, mixed_run)
    cluster, ra = a["cluster"], a["replicas"]["a"]
    assert (cluster["rejected"], cluster["failed"]) == (1, 1)
    assert (ra["rejected"], ra["failed"], a["replicas"]["b"]["failed"]) == (0, 1, 0)
    assert cluster["slo_attainment"] == pytest.approx(3 / 5) and ra["slo_attainment"] == pytest.approx(2 / 3)
    assert cluster["goodput"] == pytest.approx((4 + 4 + 6) / cluster["makespan"])


def test_idle_replica_counts_in_imbalance(store):
    """A replica that only appears in a routing decision's scores got nothing, and counts as
    zero in the imbalance (2 requests on a, none on b -> max/mean 2.0), with empty latency rows."""
    run = store.begin_run("idle", {}, "continuous", "round-robin", 0)
    store.add_requests(run, [request("r1", "a", 0.0, 2), request("r2", "a", 0.0, 2)])
    store.add_decisions(run, [decision("r1", "a", {"a": 0.0, "b": 1.0})])
    a = analyze(store, run)
    assert a["replicas"]["b"]["num_requests"] == 0 and a["replicas"]["b"]["ttft"]["p50"] is None
    assert a["imbalance"]["requests"] == pytest.approx(2.0)


def _report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="slotserve")
    add_report_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", *argv])
    return args.func(args)


def test_report_command_table_csv_json(store, mixed_run, capsys):
    """`slotserve report` prints the table with the SLO limits, a cluster row and a row per
    replica; --csv has one row per scope; --json parses; 'latest' and --slo-* are honoured."""
    db = str(store.path)
    assert _report(["latest", "--store", db]) == 0
    table = capsys.readouterr().out
    assert f"run {mixed_run} 'mixed': complete" in table and "SLO: TTFT <= 2.0 s, TPOT <= 0.25 s" in table
    assert [line.split()[0] for line in table.splitlines()[4:7]] == ["cluster", "a", "b"]
    assert "requests 1.50, output tokens 1.25" in table

    _report([str(mixed_run), "--store", db, "--csv", "--slo-ttft", "0.1"])
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["scope"], r["replica_id"]) for r in rows] == [("cluster", ""), ("replica", "a"), ("replica", "b")]
    assert rows[0]["slo_ttft"] == "0.1" and float(rows[0]["slo_attainment"]) == 0.0  # every TTFT is 0.5 s
    assert rows[1]["num_requests"] == "3" and float(rows[0]["imbalance_requests"]) == 1.5

    _report([str(mixed_run), "--store", db, "--json"])
    (analysis,) = json.loads(capsys.readouterr().out)
    assert analysis["replicas"]["a"]["num_requests"] == 3 and analysis["cluster"]["ttft"]["p50"] == 0.5


def test_report_errors_name_the_run_and_the_store(store, mixed_run, tmp_path):
    """An unknown run id is an error naming it and the ids stored (unquoted, as the CLI prints
    it); a missing store file names the path; a RUN that is neither an id nor 'latest' is named."""
    with pytest.raises(UnknownRunError) as err:
        _report(["42", "--store", str(store.path)])
    assert str(err.value) == f"no run 42 in {store.path}; runs stored: {mixed_run}"
    missing = tmp_path / "nowhere.db"
    with pytest.raises(StoreError, match=f"no metrics store at {missing}"):
        _report(["1", "--store", str(missing)])
    assert not missing.exists()
    with pytest.raises(StoreError, match="got 'newest'"):
        _report(["newest", "--store", str(store.path)])


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_store_actor_writes_for_remote_callers(local_ray, tmp_path):
    """The named store actor writes batches sent through Ray to the file (readable by another
    process), returns reads, and passes typed errors back."""
    from cluster.store_actor import STORE_ACTOR_NAME, StoreActor

    ray, path = local_ray, tmp_path / "s.db"
    actor = StoreActor.options(name=STORE_ACTOR_NAME).remote(str(path))
    run = ray.get(actor.begin_run.remote("via-ray", {}, "continuous", "round-robin", 0))
    ray.get(
        [
            actor.add_requests.remote(run, [request("r1", "a", 0.0, 3)]),
            actor.add_step_records.remote(run, "a", 1, [StepRecord(0, 0.0, 0.01, 1, 0, 1, 1, 1, 1, 0, 0)]),
        ]
    )
    ray.get(ray.get_actor(STORE_ACTOR_NAME).end_run.remote(run))
    assert MetricsStore(path).run(run)["complete"]
    assert [r["output_len"] for r in ray.get(actor.requests.remote(run))] == [3]
    with pytest.raises(UnknownRunError, match="no run 99"):
        ray.get(actor.run.remote(99))


def test_report_prints_ttft_p90_between_p50_and_p99(store, capsys):
    """The report's table has TTFT p90 (the percentile routers are compared on) between p50 and
    p99, each the percentile of the run's TTFTs."""
    run = store.begin_run("spread", {"replicas": 1}, "continuous", "least_loaded", 0)
    ttfts = [0.1 * k for k in range(1, 11)]
    store.add_requests(run, [request(f"r{k}", "a", float(k), 3, ttft=t) for k, t in enumerate(ttfts)])
    store.end_run(run)
    assert _report([str(run), "--store", str(store.path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "TTFT p50" in line)
    cluster = next(line for line in lines if line.startswith("cluster"))

    def cell(name: str) -> float:  # columns are right-aligned under their header
        end = header.index(name) + len(name)
        return float(cluster[end - len(name) : end])

    assert header.index("TTFT p50") < header.index("TTFT p90") < header.index("TTFT p99")
    for name, q in (("TTFT p50", 50), ("TTFT p90", 90), ("TTFT p99", 99)):
        assert cell(name) == pytest.approx(float(np.percentile(ttfts, q)), abs=5e-4)
