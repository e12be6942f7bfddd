"""Replicas of different speeds: `cost_scales` from the experiment file to the simulator's
config, to the cluster spec and to the fake replicas on Ray, each stepping at its own multiple
of one cost model. Pure objects, apart from one small Ray test."""

from __future__ import annotations

import pytest

from protocol.cost import LinearCostModel
from replica.config import EngineConfig
from replica.model.fake import FlatCostModel
from replica.serving.loop import ReplicaConfig
from sim.simulator import SimulationConfig, simulate
from workloads.standard import heavy_tail_spec

STEP = LinearCostModel(c0=0.01, c_decode=0.001, c_prefill=0.0005, c_ctx=0.0, c_held=0.0)


def test_simulator_prices_each_replica_at_its_cost_scale():
    """`cost_scales` makes each simulated replica's steps cost its own multiple: the same
    prompts on two replicas take twice as long on the one at twice the scale."""
    workload = heavy_tail_spec(num_requests=40, rate=2.0, seed=1).build()
    config = SimulationConfig(num_replicas=2, routing_policy="round_robin", cost_scales=[1.0, 2.0])
    result = simulate(workload, config, FlatCostModel(0.01))
    durations = {r: sorted({round(s.duration, 9) for s in steps}) for r, steps in result.steps.items()}
    assert durations == {"r0": [0.01], "r1": [0.02]}


def test_cluster_spec_gives_each_fake_replica_its_cost_scale():
    """`ClusterSpec.cost_scales` scales each fake replica's step prices (and repeats past the
    list, for replicas an autoscaler adds); it refuses a real model, whose speed is its own."""
    from cluster.deploy import ClusterSpec

    spec = ClusterSpec(num_replicas=2, replica=ReplicaConfig(fake_cost=STEP), cost_scales=[1.0, 3.0])
    assert [spec.replica_config(i).fake_cost for i in range(3)] == [STEP, STEP.scaled(3.0), STEP]
    with pytest.raises(ValueError, match="fake"):
        ClusterSpec(num_replicas=2, cost_scales=[1.0, 2.0])


def test_cost_scales_reach_the_fake_replicas_on_ray(tmp_path):
    """On Ray, each fake replica of a cluster with `cost_scales` runs at its own step time."""
    import ray

    from cluster.deploy import ClusterSpec, start_cluster, stop_cluster

    ray.init(address="local", num_cpus=2, namespace="slotserve", include_dashboard=False, log_to_driver=False)
    try:
        spec = ClusterSpec(
            num_replicas=2,
            replica=ReplicaConfig(engine=EngineConfig(num_slots=2, max_seq_len=64), fake_step_seconds=0.005),
            cost_scales=[1.0, 4.0],
            num_cpus_per_replica=0.5,
            store_path=str(tmp_path / "store.db"),
        )
        deployment = start_cluster(spec)
        infos = ray.get([deployment.replicas[f"replica-{i}"].info.remote() for i in range(2)])
        assert [info.fake_step_seconds for info in infos] == [0.005, 0.02]
    finally:
        stop_cluster()
        ray.shutdown()


def test_experiment_file_gives_each_replica_its_speed(tmp_path):
    """An experiment file's `cost_scales` reach the simulator's config, need one scale per
    replica, and refuse Ray Serve's routers on Ray (one deployment of identical replicas)."""
    import shutil

    from experiments.backends import SimulatedBackend
    from experiments.plan import plan_experiment
    from workloads.experiment import ExperimentError

    shipped = "workloads/experiments/heterogeneous.toml"
    shutil.copy("workloads/experiments/cost_model.json", tmp_path)
    plan = plan_experiment(shipped, simulate=True)
    config = SimulatedBackend(plan, None)._config(plan.cells[0], "predicted_latency", 0)
    assert config.cost_scales == [0.0625, 0.0625, 0.25, 0.25]
    text = open(shipped).read()
    for change, error in (
        (("cost_scales = [0.0625, 0.0625, 0.25, 0.25]", "cost_scales = [0.0625, 0.25]"), "one scale per replica"),
        (('"predicted_latency"]', '"predicted_latency", "serve_power_of_two"]'), "identical replicas"),
    ):
        path = tmp_path / "het.toml"
        path.write_text(text.replace(*change))
        with pytest.raises(ExperimentError, match=error):
            plan_experiment(path)
