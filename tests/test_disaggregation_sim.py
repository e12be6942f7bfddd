"""Prefill/decode disaggregation in the simulator (`sim.disaggregation`), the experiment
files' pools (`[cluster] prefill_replicas`, `sweep.pools`). The local-routing client's refusal
of a cluster with pools is checked on Ray in test_disaggregation_cluster."""

from __future__ import annotations

import textwrap

import pytest

from experiments.experiment_report import format_summary, summarize_runs
from experiments.plan import plan_experiment
from experiments.run import run_experiment
from metrics.store import MetricsStore
from protocol.handover import SAME_NODE, KvLink
from replica import EngineConfig
from replica.errors import ConfigError
from replica.model.fake import DEFAULT_KV_BYTES_PER_TOKEN, FlatCostModel
from sim.disaggregation import SimPools, simulate_pools, transfer_summary
from sim.simulator import SimulationConfig, simulate
from workloads.experiment import ExperimentError
from workloads.standard import bursty_mix
from workloads.workload import Workload, WorkloadRequest

COST = FlatCostModel(0.01)


def config(replicas: int = 3, **engine) -> SimulationConfig:
    return SimulationConfig(
        num_replicas=replicas,
        engine=EngineConfig(**{"policy": "chunked", "num_slots": 4, "max_seq_len": 640, "token_budget": 64, **engine}),
    )


def prefill_heavy(n: int = 40, seed: int = 3) -> Workload:
    """Bursty traffic, 60% of prompts 480 tokens (past the decider's threshold), the rest short."""
    return bursty_mix(n, rate=20.0, long_prompt_share=0.6, seed=seed)


def test_long_prompts_are_handed_over_and_decode_on_the_decode_pool_with_the_same_tokens():
    workload = prefill_heavy()
    pools = SimPools(prefill_replicas=1, threshold=256)
    result, transfers = simulate_pools(workload, config(), pools, COST, check_invariants=True)
    colocated = simulate(workload, config(), COST)
    assert result.token_ids == colocated.token_ids  # the hand-over continues each request exactly
    long = {f"{workload.name}-{i}" for i, r in enumerate(workload.requests) if r.prompt_len >= 256}
    assert {t.request_id for t in transfers} == long
    assert all(t.source == "r0" for t in transfers)
    for trace in result.traces:  # every request ends on a decode replica
        assert trace.finish_reason == "length" and trace.replica in ("r1", "r2")
        assert len(trace.token_times) == workload.requests[int(trace.request_id.rsplit("-", 1)[1])].output_len
    spec = {f"{workload.name}-{i}": r for i, r in enumerate(workload.requests)}
    for t in transfers:  # the prompt's K/V and the first token's: a fake's stated bytes, priced on the link
        assert t.nbytes == spec[t.request_id].prompt_len * DEFAULT_KV_BYTES_PER_TOKEN
        assert t.seconds == pytest.approx(SAME_NODE.latency_s + t.nbytes / SAME_NODE.bandwidth_bytes_per_s)
    assert transfer_summary(transfers)["handovers"] == len(long)
    routed: dict[str, list[str]] = {}
    for decision in result.decisions:
        routed.setdefault(decision.request_id, []).append(decision.replica_id)
    for rid, replicas in routed.items():  # a long prompt to the prefill pool, then moved to the decode pool
        assert replicas[0] == "r0" and replicas[1] in ("r1", "r2") if rid in long else replicas[0] in ("r1", "r2")


def test_the_link_delays_the_second_token_by_the_hand_overs_price():
    one = Workload("one", 0, [WorkloadRequest(arrival=0.0, prompt_len=400, output_len=4)])
    slow = KvLink(bandwidth_bytes_per_s=1e8, latency_s=0.5)
    times = {}
    for name, link in (("same", SAME_NODE), ("slow", slow)):
        result, transfers = simulate_pools(one, config(2), SimPools(prefill_replicas=1, link=link), COST)
        (trace,) = result.traces
        times[name] = trace.token_times
        assert transfers[0].seconds == pytest.approx(link.seconds(400 * DEFAULT_KV_BYTES_PER_TOKEN))
    assert times["slow"][0] == times["same"][0]  # the first token comes from the prefill replica
    extra = slow.seconds(400 * DEFAULT_KV_BYTES_PER_TOKEN) - SAME_NODE.seconds(400 * DEFAULT_KV_BYTES_PER_TOKEN)
    assert times["slow"][1] - times["same"][1] == pytest.approx(extra)


def test_a_full_decode_pool_makes_hand_overs_wait_and_none_is_lost():
    workload = prefill_heavy(60)
    sim_config = config().model_copy(update={"engine": config().engine.model_copy(update={"num_slots": 1})})
    result, transfers = simulate_pools(workload, sim_config, SimPools(prefill_replicas=2), COST, check_invariants=True)
    assert len(result.traces) == 60 and all(t.finish_reason == "length" for t in result.traces)
    assert {t.replica for t in result.traces} == {"r2"}


def test_pools_need_a_decode_replica_and_a_known_decider():
    with pytest.raises(ConfigError, match="leave no decode replica"):
        simulate_pools(prefill_heavy(4), config(2), SimPools(prefill_replicas=2), COST)
    with pytest.raises(ValueError, match="P/D decider"):
        SimPools(prefill_replicas=1, decider="nope")


EXPERIMENT = """\
name = "pd"

[workload]
standard = "bursty-mix"
args = {{ num_requests = 12, long_prompt_share = 0.5 }}

[cluster]
{cluster}
slots = 4
max_seq_len = 640
model = "fake"
fake_step_seconds = 0.01

[sweep]
batching = ["chunked"]
load = [0.8]
{sweep}
"""


def write(tmp_path, cluster: str = "replicas = 3", sweep: str = 'pools = ["0:3", "1:2"]'):
    path = tmp_path / "pd.toml"
    path.write_text(textwrap.dedent(EXPERIMENT.format(cluster=cluster, sweep=sweep)))
    return path


def test_the_pools_axis_runs_colocated_and_split_cells_on_the_same_traffic(tmp_path):
    plan = plan_experiment(write(tmp_path), simulate=True)
    assert [c.pools for c in plan.cells] == ["0:3", "1:2"]
    assert plan.pools(plan.cells[0]) is None and plan.pools(plan.cells[1]).prefill_replicas == 1
    result = run_experiment(plan, simulate=True, store_path=tmp_path / "s.db", progress=False)
    store = MetricsStore(tmp_path / "s.db")
    colocated, split = (store.run(run_id) for _, run_id in result.runs)
    assert colocated["config"]["workload_spec"] == split["config"]["workload_spec"]
    assert "handovers" not in colocated["config"] and split["config"]["handovers"] > 0
    assert {t.replica for t in store.traces(result.runs[1][1])} <= {"r1", "r2"}
    # the table shows the TPOT tail and the hand-over time only where a cell hands over
    table = format_summary(summarize_runs(result))
    assert "TPOT p99 s" in table and "hand-over s" in table
    colocated_only = plan_experiment(write(tmp_path, sweep='pools = ["0:3"]'), simulate=True)
    result = run_experiment(colocated_only, simulate=True, store_path=tmp_path / "c.db", progress=False)
    assert "TPOT p99 s" not in format_summary(summarize_runs(result))


def test_cluster_pools_set_the_replicas_and_bad_splits_name_their_line(tmp_path):
    plan = plan_experiment(
        write(tmp_path, 'prefill_replicas = 1\ndecode_replicas = 2\nkv_link = "cross_node"', ""), simulate=True
    )
    assert plan.experiment.cluster.replicas == 3 and plan.pools(plan.cells[0]).link.latency_s == 0.002
    with pytest.raises(ExperimentError, match=r"pd.toml:\d+: sweep.pools\[1\]: '2:2' must split cluster.replicas = 3"):
        plan_experiment(write(tmp_path, sweep='pools = ["0:3", "2:2"]'))
    with pytest.raises(ExperimentError, match="must be prefill_replicas \\+ decode_replicas = 3"):
        plan_experiment(write(tmp_path, "replicas = 4\nprefill_replicas = 1\ndecode_replicas = 2", ""))
    with pytest.raises(ExperimentError, match="cluster.pd_decider: unknown P/D decider 'nope'"):
        plan_experiment(write(tmp_path, 'replicas = 3\npd_decider = "nope"'))


def test_the_shipped_experiment_plans():
    plan = plan_experiment("workloads/experiments/disaggregation.toml", simulate=True)
    assert {c.pools for c in plan.cells} == {"0:4", "1:3", "2:2", "3:1"}
    # Colocated and split cells are offered the same budgets and slot counts.
    for pools in ("0:4", "3:1"):
        assert {(c.token_budget, c.slots) for c in plan.cells if c.pools == pools} == {
            (budget, slots) for budget in (64, 128, 256, 512) for slots in (8, 12)
        }


def test_the_report_sets_the_best_split_against_the_best_colocated_seed_by_seed(tmp_path):
    from types import SimpleNamespace

    from experiments.experiment_report import SummaryRow
    from experiments.plan import Cell
    from experiments.pools_report import against_colocated

    plan = plan_experiment(write(tmp_path), simulate=True)

    def row(pools: str, budget: int, goodput: list[float], load: float = 0.8, seeds=(0, 1, 2)) -> SummaryRow:
        cell = Cell("chunked", "least_loaded", load, budget, 4, 0, pools=pools)
        return SummaryRow(cell, values={"goodput": goodput}, seeds=list(seeds)[: len(goodput)])

    rows = [
        row("0:3", 64, [10.0, 12.0, 11.0]),
        row("0:3", 128, [12.0, 13.0, 14.0]),  # the best colocated: median 13
        row("1:2", 64, [20.0, 12.5, 26.0]),  # the best split: median 20, behind on the second seed
        row("1:2", 128, [15.0, 16.0, 17.0]),
        row("0:3", 64, [30.0, 30.0], load=0.5),  # at 0.5 colocated wins on both seeds
        row("1:2", 64, [20.0, 29.0], load=0.5, seeds=(1, 0)),  # its runs in another order: paired by seed
    ]
    lines = against_colocated(SimpleNamespace(plan=plan), rows)
    assert lines == [
        "load=0.8: split wins, (pools 1:2, budget 64, 4 slots) 20.0 good tok/s = 1.54x the best colocated, "
        "(pools 0:3, budget 128, 4 slots) 13.0; by seed 1.67x / 0.96x / 1.86x; does not hold on every seed",
        "load=0.5: colocated wins, (pools 0:3, budget 64, 4 slots) 30.0 good tok/s = 1.22x the best split, "
        "(pools 1:2, budget 64, 4 slots) 24.5; by seed 1.03x / 1.50x; holds on every seed",
    ]
    assert against_colocated(SimpleNamespace(plan=plan), [r for r in rows if r.cell.pools == "0:3"]) == []


def test_fidelity_names_each_sides_winner_per_point_of_the_sweep():
    from benchmarks.experiment_fidelity import winners

    def key(pools: str, budget: int, load: float = 1.0) -> tuple:
        return ("least_loaded", load, "chunked", 12, budget, "w", pools, "")

    def point(load: float) -> tuple:
        return ("least_loaded", load, "chunked", None, None, "w", None, "")

    side = {
        key("0:4", 128): {"goodput": 10.0},
        key("0:4", 512): {"goodput": 12.0},  # the best colocated beats the best split
        key("3:1", 512): {"goodput": 11.0},
        key("0:4", 128, 0.7): {"goodput": 4.0},
        key("1:3", 128, 0.7): {"goodput": 5.0},
        key("1:3", 128, 0.4): {"goodput": 5.0},  # no colocated cell at 0.4: no winner there
    }
    assert winners(side) == {point(1.0): "colocated", point(0.7): "split"}
