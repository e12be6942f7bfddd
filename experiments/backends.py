"""Where an experiment's cells run: `SimulatedBackend` (the simulator, recorded by this
process) and `RayBackend` (a Ray cluster it starts and stops), each measuring the capacity a
cell's load is a multiple of and running one cell into the store. `measure_capacity` and
`routing_experiment` also serve `slotserve run`.

Load is a multiple of capacity measured for the cluster shape (`workloads.capacity`): two
saturating probes through the router, one decoding (output tokens/s) and one prefilling
(prompt tokens/s) (real: the median of three each; simulated: the same probes on virtual time,
which is deterministic), once per slots-per-replica value, so every batching and routing
policy at one slot count sees exactly the same traffic.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import ray
from tqdm import tqdm

from cluster.client import Client, Result
from cluster.deploy import Deployment
from cluster.driver import run_workload
from cluster.serve_baseline import SERVE_ROUTERS, ServeBaseline
from experiments.plan import Cell, Plan
from metrics.live import PROBE_REQUEST_PREFIX
from metrics.store import MetricsStore
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

    async def send_all(client: Client, probe: Workload) -> list[Result]:
        prompts = [request_prompt(probe.seed, i, spec, vocab_size) for i, spec in enumerate(probe.requests)]
        return await asyncio.gather(
            *[_probe_request(client, p, spec.output_len, bar) for p, spec in zip(prompts, probe.requests)]
        )

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
) -> list[int]:
    """Replay a seeded workload once per routing policy in each of `repeats` rounds, round r
    with seed `seed + r` (its own traffic, so a lead that holds across rounds holds across
    arrival sequences, not only across reruns of one), the policies' order reversed every other
    round so a drift of the machine favours none; returns the run ids."""
    capacity = measure_capacity(deployment, progress=progress)
    batching = ray.get(next(iter(deployment.replicas.values())).info.remote()).policy
    run_ids = []
    for r in range(repeats):
        workload = at_load(workload_name, num_requests, load, capacity, seed + r)
        for policy in routing_policies if r % 2 == 0 else routing_policies[::-1]:
            ray.get(deployment.router.set_policy.remote(policy))
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


class SimulatedBackend:
    """Cells in the simulator, recorded by this process (the store's only writer here)."""

    def __init__(self, plan: Plan, store: MetricsStore):
        self.plan, self.store = plan, store
        self.vocab_size: int | None = None  # the simulated model's vocabulary, read when capacity is measured

    def _config(self, cell: Cell, routing: str, seed: int):
        from sim.simulator import SimulationConfig

        return SimulationConfig(
            num_replicas=self.plan.experiment.cluster.replicas,
            engine=self.plan.engine_config(cell),
            routing_policy=routing,
            seed=seed,
            cost_scales=self.plan.experiment.cluster.cost_scales,
        )

    def capacity(self, cell: Cell) -> Capacity:
        from sim.simulator import measure_capacity as simulated_capacity

        config = self._config(cell, DEFAULT_POLICY, 0)
        self.vocab_size = config.vocab_size
        return simulated_capacity(config, self.plan.cost)

    def run(self, cell: Cell, workload: Workload, name: str, config: dict, slo: dict) -> int:
        from sim.simulator import record_simulation, simulate

        result = simulate(workload, self._config(cell, cell.routing, cell.seed), self.plan.cost)
        return record_simulation(self.store, result, name, slo, extra_config=config)

    def close(self) -> None:
        pass


class RayBackend:
    """Cells on a Ray cluster this experiment starts (and stops): slotserve's replicas and
    router, or, for a cell routed by one of Ray Serve's routers, the same replica engine as a
    Ray Serve application (`cluster.serve_baseline`) recording into a store actor of its own.
    slotserve's cluster is restarted only when the cell's batching policy, slots or token budget
    differ from the last cell's (each run starts its replicas' prefix caches empty); a Serve cell
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

    def _deploy(self, cell: Cell) -> Deployment:
        from cluster.deploy import ClusterSpec, start_cluster

        if self.deployed != cell.deployment:
            self.close()
            c = self.plan.experiment.cluster
            spec = ClusterSpec(
                num_replicas=c.replicas,
                routing_policy=DEFAULT_POLICY if cell.routing in SERVE_ROUTERS else cell.routing,
                replica=self._replica_config(cell),
                num_cpus_per_replica=c.num_cpus,
                num_gpus_per_replica=c.num_gpus,
                store_path=str(self.store_path),
                cost_scales=c.cost_scales,
            )
            self.deployment, self.deployed = start_cluster(spec), cell.deployment
        return self.deployment

    def _deploy_serve(self, cell: Cell) -> ServeBaseline:
        from cluster.store_actor import StoreActor

        self.close()
        c = self.plan.experiment.cluster
        self.serve_store = StoreActor.remote(str(self.store_path.resolve()))
        self.serve = ServeBaseline(
            self._replica_config(cell), c.replicas, cell.routing, self.serve_store, c.num_cpus, c.num_gpus
        )
        return self.serve

    def capacity(self, cell: Cell) -> Capacity:
        """Measured on slotserve's cluster (with its default policy) for every cell, Serve's
        included: the same engine at the same slots, so both see the same traffic."""
        deployment = self._deploy(cell)
        ray.get(deployment.router.set_policy.remote(DEFAULT_POLICY))
        self.vocab_size = ray.get(next(iter(deployment.replicas.values())).info.remote()).vocab_size
        return measure_capacity(deployment)

    def run(self, cell: Cell, workload: Workload, name: str, config: dict, slo: dict) -> int:
        run = {"name": name, "config": config, "batching_policy": cell.batching, "seed": cell.seed, "slo": slo}
        if cell.routing in SERVE_ROUTERS:
            return self._deploy_serve(cell).run_workload(workload, vocab_size=self.vocab_size, **run)
        deployment = self._deploy(cell)
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
