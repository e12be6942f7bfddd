"""Replay a workload through a running cluster and record it in the metrics store.

Each request is submitted at its planned time (the driver records how late it was, so a
slow driver cannot pass for a slow cluster) with many requests in flight at once; each
finished request is written with its client-side timestamps in batches. The run is marked
complete only when every request has ended and the replicas and router have flushed: a run
cut short (Ctrl-C, a killed driver) keeps what was recorded and reads as incomplete."""

from __future__ import annotations

import asyncio
import time

import ray
from tqdm import tqdm

from cluster.client import Client, Result
from cluster.deploy import Deployment
from replica.errors import SlotServeError
from workloads.workload import Workload, WorkloadRequest, request_prompt

REQUEST_BATCH = 32  # request rows per store write


def request_row(spec: WorkloadRequest, result: Result, planned: float, submitted: float) -> dict:
    return {
        "request_id": result.request_id, "replica_id": result.replica_id, "session_id": spec.session_id,
        "planned_arrival": planned, "arrival": result.arrival or submitted, "submit_lateness": submitted - planned,
        "first_token": result.token_times[0] if result.token_times else None,
        "completion": result.completion or time.time(), "prompt_len": spec.prompt_len,
        "output_len": len(result.token_ids), "max_tokens": spec.output_len, "finish_reason": result.finish_reason,
        "error": result.error, "token_times": result.token_times,
    }


async def _replay(client: Client, workload: Workload, run_id: int, store, vocab_size: int, seed: int,
                  progress: bool) -> None:
    rows: list[dict] = []
    bar = tqdm(total=len(workload.requests), desc=workload.name, unit="req", disable=not progress)

    async def flush() -> None:
        batch, rows[:] = list(rows), []
        if batch:
            await store.add_requests.remote(run_id, batch)

    async def one(i: int, spec: WorkloadRequest, planned: float) -> None:
        submitted = time.time()
        prompt = request_prompt(seed, i, spec, vocab_size)
        rid = f"run{run_id}-{i}"
        try:
            result = await client.agenerate(prompt, session_id=spec.session_id, request_id=rid,
                                            max_tokens=spec.output_len, ignore_eos=True)
        except SlotServeError as err:
            reason = "rejected" if isinstance(err, ValueError) else "error"
            result = Result(rid, None, submitted, finish_reason=reason, error=str(err), completion=time.time())
        rows.append(request_row(spec, result, planned, submitted))
        bar.update(1)
        if len(rows) >= REQUEST_BATCH:
            await flush()

    t0 = time.time()
    tasks = []
    try:
        for i, spec in enumerate(workload.requests):
            delay = t0 + spec.arrival - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, spec, t0 + spec.arrival)))
        await asyncio.gather(*tasks)
    finally:
        await flush()  # keep what finished, even when cut short
        bar.close()


def run_workload(deployment: Deployment, workload: Workload, *, name: str, config: dict, batching_policy: str,
                 routing_policy: str, seed: int = 0, slo: dict | None = None, progress: bool = True) -> int:
    """Replay `workload` and return its run id in the store."""
    store = deployment.store
    run_id = ray.get(store.begin_run.remote(name, config, batching_policy, routing_policy, seed, slo))
    actors = [deployment.router, *deployment.replicas.values()]
    ray.get([a.set_run.remote(run_id) for a in actors])
    vocab = ray.get(next(iter(deployment.replicas.values())).info.remote())["vocab_size"]
    with Client() as client:
        asyncio.run(_replay(client, workload, run_id, store, vocab, seed, progress))
    ray.get([a.flush.remote() for a in actors])
    ray.get(store.end_run.remote(run_id, "complete"))
    return run_id
