"""Where an experiment's cells run: `SimulatedBackend` (the simulator, recorded by this
process) and `RayBackend` (a Ray cluster it starts and stops), each measuring the capacity a
cell's load is a multiple of and running one cell into the store. `measure_capacity` and
`routing_experiment` also serve `slotserve run`.

Load is a multiple of capacity measured for the cluster shape (`workloads.capacity`): two
saturating probes through the router, one decoding (output tokens/s) and one prefilling
(prompt tokens/s) (real: the median of three each; simulated: the same probes on virtual time,
which is deterministic), once per slots-per-replica value, so every batching and routing
policy at one slot count sees exactly the same traffic.

Capacity is measured on `cluster.replicas` replicas without pools (a prefill:decode split,
`sweep.pools`, serves the same traffic as the colocated cells: on Ray a cluster started with the
pools, in the simulator `sim.disaggregation`); a cell sized otherwise (`sweep.autoscale`:
an autoscaling policy from its `min` replicas, or a static size) runs on a cluster of its own,
its policy pricing work at one replica's share of that capacity. On Ray an autoscaled cell gets
a fresh cluster with its controller (`cluster.autoscaler`); in the simulator it runs on
`sim.autoscaling.AutoscalingSimulator`, the same policy objects on virtual time. A cell routed
by a Ray Serve router runs on Serve with the cell's replica count, or, sized by `target_ongoing`,
grown and shrunk by Serve's own autoscaler on that policy's parameters (the simulator has no
Serve: there `target_ongoing` is the same rule).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from pathlib import Path

import ray
from tqdm import tqdm

from autoscaling.policies import AutoscaleConfig
from cluster.client import Client, Result
from cluster.deploy import Deployment
from cluster.driver import run_workload
from cluster.serve_baseline import SERVE_ROUTERS, ServeBaseline
from experiments.plan import Cell, Plan
from metrics.definitions import SLO, RequestTrace
from metrics.live import PROBE_REQUEST_PREFIX
from metrics.store import MetricsStore
from protocol import defaults
from protocol.handover import SAME_NODE
from replica.errors import ConfigError
from router.policies import DEFAULT_POLICY
from workloads.capacity import PREFILL_PROBE_ROUNDS, PROBE_MAX_TOKENS, Capacity, prefill_probe_len, probe_capacity
from workloads.standard import at_load
from workloads.workload import Workload, request_prompt


async def _probe_request(client: Client, prompt: list[int], max_tokens: int, bar: tqdm) -> Result:
    """One probe request, under a probe's request id (its live metrics are labelled `probe`)."""
    result = await client.agenerate(
        prompt, request_id=f"{PROBE_REQUEST_PREFIX}{uuid.uuid4().hex}", max_tokens=max_tokens, ignore_eos=True
    )
    bar.update()
    return result


def measure_capacity(
    deployment: Deployment, max_tokens: int = PROBE_MAX_TOKENS, probes: int = 3, progress: bool = False
) -> Capacity:
    """The whole cluster's capacity with every slot of every replica busy
    (`workloads.capacity.probe_capacity`), each probe sent through the router (not recorded);
    the median of `probes` of each, since a real cluster's figures vary from run to run."""
    infos = ray.get([r.info.remote() for r in deployment.replicas.values()])
    slots, vocab_size = sum(i.num_slots for i in infos), min(i.vocab_size for i in infos)
    if progress:  # it saturates the cluster, and can take longer than the run it sets the load of
        prompt_len = prefill_probe_len(min(i.max_request_tokens for i in infos))
        print(
            f"measuring the cluster's capacity (the load is a multiple of it): {probes} decode probes of {slots} "
            f"requests x {max_tokens} tokens and {probes} prefill probes of {PREFILL_PROBE_ROUNDS * slots} "
            f"{prompt_len}-token prompts, each filling every slot; not recorded (live metrics: run=probe), "
            "time left on the bar",
            flush=True,
        )
    started = time.monotonic()
    bar = tqdm(
        total=probes * (1 + PREFILL_PROBE_ROUNDS) * slots, desc="capacity probe", unit="req", disable=not progress
    )

    async def send_all(client: Client, probe: Workload) -> list[RequestTrace]:
        prompts = [request_prompt(probe.seed, i, spec, vocab_size) for i, spec in enumerate(probe.requests)]
        results = await asyncio.gather(
            *[_probe_request(client, p, spec.output_len, bar) for p, spec in zip(prompts, probe.requests)]
        )
        return [result.trace(spec.prompt_len) for result, spec in zip(results, probe.requests)]

    with Client() as client, bar:
        capacity = probe_capacity(
            lambda probe: asyncio.run(send_all(client, probe)),
            slots,
            min(i.max_request_tokens for i in infos),
            probes,
            max_tokens,
        )
    if progress:
        print(
            f"capacity: {capacity.decode_tokens_per_s:.1f} output tokens/s, {capacity.prefill_tokens_per_s:.0f} "
            f"prompt tokens/s (measured in {time.monotonic() - started:.1f} s)"
        )
    return capacity


def routing_experiment(
    deployment: Deployment,
    routing_policies: list[str],
    workload_name: str,
    num_requests: int,
    load: float,
    seed: int,
    config: dict,
    progress: bool = True,
    repeats: int = 1,
    tpot_slo: float = defaults.TPOT_SLO,
) -> list[int]:
    """Replay a seeded workload once per routing policy in each of `repeats` rounds, round r
    with seed `seed + r` (its own traffic, so a lead that holds across rounds holds across
    arrival sequences, not only across reruns of one), the policies' order reversed every other
    round so a drift of the machine favours none, each routed within `tpot_slo` (the TPOT limit
    the runs are judged by); returns the run ids."""
    capacity = measure_capacity(deployment, progress=progress)
    batching = ray.get(next(iter(deployment.replicas.values())).info.remote()).policy
    run_ids = []
    for r in range(repeats):
        workload = at_load(workload_name, num_requests, load, capacity, seed + r)
        for policy in routing_policies if r % 2 == 0 else routing_policies[::-1]:
            ray.get(deployment.router.set_policy.remote(policy, tpot_slo))
            stamp = time.strftime("%H%M%S")
            run_ids.append(
                run_workload(
                    deployment,
                    workload,
                    name=f"{workload_name}-{policy}-seed{seed + r}-{stamp}",
                    config={**config, "workload": workload.describe(), "workload_params": workload.params},
                    batching_policy=batching,
                    routing_policy=policy,
                    seed=seed + r,
                    progress=progress,
                )
            )
    return run_ids


def experiment_slo(plan: Plan) -> SLO:
    """The SLO the experiment's runs are judged by (its `[slo]`), which their router routes within."""
    return SLO(**plan.experiment.slo.model_dump())


class SimulatedBackend:
    """Cells in the simulator, recorded by this process (the store's only writer here)."""

    def __init__(self, plan: Plan, store: MetricsStore):
        self.plan, self.store = plan, store
        self.vocab_size: int | None = None  # the simulated model's vocabulary, read when capacity is measured

    def _config(self, cell: Cell, routing: str, seed: int, replicas: int | None = None, flow: bool = True):
        """The cell's simulation (`flow=False`: without its flow control, as capacity is measured)."""
        from sim.simulator import SimulationConfig

        return SimulationConfig(
            num_replicas=replicas or self.plan.experiment.cluster.replicas,
            engine=self.plan.engine_config(cell),
            routing_policy=routing,
            seed=seed,
            cost_scales=self.plan.experiment.cluster.cost_scales,
            step_overhead=self.plan.experiment.cluster.step_overhead,
            dispatch_delay=self.plan.experiment.cluster.dispatch_delay,
            submit_interval=self.plan.experiment.cluster.submit_interval,
            slo=experiment_slo(self.plan),
            flow=self.plan.flow(cell) if flow else None,
        )

    def capacity(self, cell: Cell) -> Capacity:
        from sim.simulator import measure_capacity as simulated_capacity

        config = self._config(cell, DEFAULT_POLICY, 0, flow=False)
        self.vocab_size = config.vocab_size
        return simulated_capacity(config, self.plan.cost)

    def run(
        self, cell: Cell, workload: Workload, name: str, config: dict, slo: dict, replicas: int, capacity: Capacity
    ) -> int:
        """One cell on `replicas` replicas (an autoscaled one's start); `capacity` is the one
        measured on `cluster.replicas`."""
        from sim.autoscaling import AutoscalingSimulator, record_autoscaling
        from sim.simulator import record_simulation, simulate

        sim_config = self._config(cell, cell.routing, cell.seed, replicas)
        autoscale = self.plan.scaling(cell)
        if (pools := self.plan.pools(cell)) is not None:
            from sim.disaggregation import simulate_pools, transfer_summary

            result, transfers = simulate_pools(workload, sim_config, pools, self.plan.cost)
            return record_simulation(self.store, result, name, slo, {**config, **transfer_summary(transfers)})
        if not isinstance(autoscale, AutoscaleConfig):
            return record_simulation(self.store, simulate(workload, sim_config, self.plan.cost), name, slo, config)
        scaled = AutoscalingSimulator(
            workload,
            sim_config,
            autoscale,
            self.plan.cost,
            self.plan.replica_capacity(capacity),
            self.plan.cold_start_s,
        ).simulate()
        run_id = record_simulation(self.store, scaled.simulation, name, slo, config)
        record_autoscaling(self.store, run_id, scaled)
        return run_id

    def close(self) -> None:
        pass


class RayBackend:
    """Cells on a Ray cluster this experiment starts (and stops): slotserve's replicas and
    router, or, for a cell routed by one of Ray Serve's routers, the same replica engine as a
    Ray Serve application (`cluster.serve_baseline`) recording into a store actor of its own.
    slotserve's cluster is restarted only when the cell's batching policy, slots, token budget,
    replica count or prefill:decode split differ from the last cell's (each run starts its replicas' prefix caches
    empty), and for every autoscaled cell (each starts at its `min` replicas); a Serve cell
    always gets a fresh application, so its replicas' caches and its router's state (the prefix
    router's tree lives in the caller's handle) start empty too."""

    def __init__(self, plan: Plan, store_path: Path, address: str | None):
        from cluster.deploy import ensure_ray

        self.plan, self.store_path = plan, store_path
        ensure_ray(address, start_local=False)
        self.deployment: Deployment | None = None
        self.serve: ServeBaseline | None = None
        self.serve_store = None
        self.deployed: tuple | None = None  # the Cell.deployment slotserve's running cluster was started for
        self.vocab_size: int | None = None  # the replicas' vocabulary, read when capacity is measured

    def _replica_config(self, cell: Cell):
        from replica.serving.loop import ReplicaConfig

        c = self.plan.experiment.cluster
        fake_cost = self.plan.cost if c.model == "fake" and c.fake_step_seconds is None else None
        return ReplicaConfig(
            engine=self.plan.engine_config(cell), fake_step_seconds=c.fake_step_seconds, fake_cost=fake_cost
        )

    def _deploy(
        self,
        cell: Cell,
        replicas: int | None = None,
        autoscale: AutoscaleConfig | None = None,
        replica_capacity: Capacity | None = None,
    ) -> Deployment:
        """slotserve's cluster for `cell`: `replicas` of them (None: cluster.replicas), grown
        and shrunk by `autoscale`'s controller when given (always a fresh cluster)."""
        from cluster.deploy import ClusterSpec, start_cluster

        c = self.plan.experiment.cluster
        replicas = replicas or c.replicas
        pools = self.plan.pools(cell)
        prefill = 0 if pools is None else pools.prefill_replicas
        flow = self.plan.flow(cell)
        wanted = (cell.batching, cell.slots, cell.token_budget, replicas, prefill, flow)
        if self.deployed != wanted or autoscale is not None:
            self.close()
            spec = ClusterSpec(
                num_replicas=replicas,
                routing_policy=DEFAULT_POLICY if cell.routing in SERVE_ROUTERS else cell.routing,
                replica=self._replica_config(cell),
                num_cpus_per_replica=c.num_cpus,
                num_gpus_per_replica=c.num_gpus,
                store_path=str(self.store_path),
                cost_scales=c.cost_scales,
                slo=experiment_slo(self.plan),
                autoscale=autoscale,
                replica_capacity=replica_capacity,
                prefill_replicas=prefill,
                decode_replicas=replicas - prefill if prefill else 0,
                pd_decider=c.pd_decider,
                pd_threshold=c.pd_threshold,
                kv_link=SAME_NODE if pools is None else pools.link,
                flow=flow,
            )
            self.deployment = start_cluster(spec)
            self.deployed = None if autoscale is not None else wanted  # an autoscaled one changes size
        return self.deployment

    def _deploy_serve(self, cell: Cell, replicas: int, autoscale: AutoscaleConfig | None) -> ServeBaseline:
        """Ray Serve's deployment for `cell`: `replicas` of them, or from there as Serve's
        autoscaler sizes it by `autoscale` (always a fresh application)."""
        from cluster.store_actor import StoreActor

        self.close()
        c = self.plan.experiment.cluster
        self.serve_store = StoreActor.remote(str(self.store_path.resolve()))
        self.serve = ServeBaseline(
            self._replica_config(cell),
            replicas,
            cell.routing,
            self.serve_store,
            c.num_cpus,
            c.num_gpus,
            autoscale=autoscale,
        )
        return self.serve

    def capacity(self, cell: Cell) -> Capacity:
        """Measured on slotserve's cluster (with its default policy) for every cell, Serve's
        included: the same engine at the same slots, so both see the same traffic."""
        deployment = self._deploy(replace(cell, pools=f"0:{self.plan.experiment.cluster.replicas}"))  # no pools
        ray.get(deployment.router.set_policy.remote(DEFAULT_POLICY))
        self.vocab_size = ray.get(next(iter(deployment.replicas.values())).info.remote()).vocab_size
        return measure_capacity(deployment)

    def run(
        self, cell: Cell, workload: Workload, name: str, config: dict, slo: dict, replicas: int, capacity: Capacity
    ) -> int:
        """One cell on `replicas` replicas (an autoscaled one's start); `capacity` is the one
        measured on `cluster.replicas`."""
        run = {"name": name, "config": config, "batching_policy": cell.batching, "seed": cell.seed, "slo": slo}
        autoscale = self.plan.scaling(cell)
        if cell.routing in SERVE_ROUTERS:
            scaled = autoscale if isinstance(autoscale, AutoscaleConfig) else None
            return self._deploy_serve(cell, replicas, scaled).run_workload(workload, vocab_size=self.vocab_size, **run)
        if isinstance(autoscale, AutoscaleConfig):
            deployment = self._deploy(cell, replicas, autoscale, self.plan.replica_capacity(capacity))
        else:
            deployment = self._deploy(cell, replicas)
        ray.get(deployment.router.set_policy.remote(cell.routing))
        return run_workload(deployment, workload, routing_policy=cell.routing, progress=False, **run)

    def close(self) -> None:
        """Stop what runs: Serve and its store actor, or the slotserve actors (waiting until
        their names are free for the next start)."""
        from cluster.deploy import stop_cluster

        if self.serve is not None:
            self.serve.shutdown()
            ray.kill(self.serve_store)
            self.serve = self.serve_store = self.deployed = None
        if self.deployment is None:
            return
        names = set(stop_cluster())
        self.deployment = self.deployed = None
        deadline = time.monotonic() + 60
        while names & {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}:
            if time.monotonic() > deadline:
                raise ConfigError(f"slotserve actors did not stop within 60 s: {sorted(names)}")
            time.sleep(0.2)
