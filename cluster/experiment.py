"""One-shot cluster experiments: measure the cluster's capacity, then replay one workload
once per routing policy on the same replicas, each run recorded in the store."""

from __future__ import annotations

import asyncio
import statistics
import time

import ray

from cluster.client import Client
from cluster.deploy import Deployment
from cluster.driver import run_workload
from workloads.standard import at_load


async def _probe(client: Client, num_requests: int, max_tokens: int) -> float:
    results = await asyncio.gather(*[
        client.agenerate([100 + i] * 32, max_tokens=max_tokens, ignore_eos=True) for i in range(num_requests)])
    first = min(r.token_times[0] for r in results)
    last = max(r.token_times[-1] for r in results)
    return sum(len(r.token_ids) - 1 for r in results) / (last - first)


def measure_capacity(deployment: Deployment, max_tokens: int = 24, probes: int = 3) -> float:
    """Output tokens/s of the whole cluster with every slot of every replica busy decoding:
    the median of a few saturating probes through the router (not recorded), so one stall
    on a busy machine does not set the load of a whole experiment."""
    infos = ray.get([r.info.remote() for r in deployment.replicas.values()])
    slots = sum(i["num_slots"] for i in infos)
    with Client() as client:
        return statistics.median(asyncio.run(_probe(client, slots, max_tokens)) for _ in range(probes))


def routing_experiment(deployment: Deployment, routing_policies: list[str], workload_name: str, num_requests: int,
                       load: float, seed: int, config: dict, progress: bool = True) -> list[int]:
    """Replay the same seeded workload once per routing policy; returns the run ids."""
    capacity = measure_capacity(deployment)
    workload = at_load(workload_name, num_requests, load, capacity, seed)
    batching = ray.get(next(iter(deployment.replicas.values())).info.remote())["policy"]
    run_ids = []
    for policy in routing_policies:
        ray.get(deployment.router.set_policy.remote(policy))
        stamp = time.strftime("%H%M%S")
        run_ids.append(run_workload(
            deployment, workload, name=f"{workload_name}-{policy}-{stamp}",
            config={**config, "workload": workload.describe(), "workload_params": workload.params},
            batching_policy=batching, routing_policy=policy, seed=seed, progress=progress))
    return run_ids
