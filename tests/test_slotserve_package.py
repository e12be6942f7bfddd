"""`import slotserve`: the user's API in one package, each name the object of the package that
implements it, used as the package docstring says: an engine on the fake model and an
experiment file run in the simulator, with the report's table."""

from __future__ import annotations

import textwrap

import slotserve
from protocol.clock import FakeClock
from replica.model.fake import FlatCostModel, ScriptedFakeRunner

EXPERIMENT = """\
name = "package"
description = "one policy, one load, one seed, through slotserve's own names"

[workload]
standard = "bursty-mix"
args = { num_requests = 8 }

[cluster]
replicas = 2
slots = 4
max_seq_len = 256
model = "fake"
fake_step_seconds = 0.01

[sweep]
batching = ["continuous"]
routing = ["least_loaded"]
load = [0.5]
seeds = [0]
"""


def test_every_exported_name_is_the_implementing_packages_object():
    """`__all__` lists what the package gives and each name is the real class or function (no
    wrapper that could drift from it)."""
    from cluster.client import Client
    from experiments.run import run_experiment
    from replica.engine import Engine

    assert all(hasattr(slotserve, name) for name in slotserve.__all__)
    assert {"Client", "Engine", "EngineConfig", "SamplingParams", "run_experiment"} <= set(slotserve.__all__)
    assert (slotserve.Client, slotserve.Engine, slotserve.run_experiment) == (Client, Engine, run_experiment)


def test_engine_on_the_fake_model_through_the_package():
    """slotserve.Engine with slotserve.EngineConfig and slotserve.SamplingParams generates every
    requested token on the fake model (no weights), each request to its own length."""
    clock = FakeClock()
    engine = slotserve.Engine(
        slotserve.EngineConfig(num_slots=2, max_seq_len=64), ScriptedFakeRunner(clock, FlatCostModel(0.01)), clock
    )
    params = [slotserve.SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 7, 5)]
    done = engine.generate([[1, 2], [3, 4, 5], [6]], params)
    assert [len(c.token_ids) for c in done] == [3, 7, 5]
    assert all(c.finish_reason.value == "length" for c in done)


def test_experiment_in_the_simulator_through_the_package(tmp_path):
    """plan_experiment, run_experiment(simulate=True), summarize_runs and format_summary: one
    recorded run, its row in the table, and its analysis readable through MetricsStore."""
    path = tmp_path / "package.toml"
    path.write_text(textwrap.dedent(EXPERIMENT))
    plan = slotserve.plan_experiment(path, simulate=True)
    result = slotserve.run_experiment(plan, simulate=True, store_path=tmp_path / "s.db", progress=False)
    rows = slotserve.summarize_runs(result)
    assert len(result.runs) == 1 and len(rows) == 1
    assert "continuous" in slotserve.format_summary(rows)
    (_, run_id), store = result.runs[0], slotserve.MetricsStore(tmp_path / "s.db")
    assert slotserve.analyze(store, run_id, slotserve.SLO())["cluster"]["num_requests"] == 8
