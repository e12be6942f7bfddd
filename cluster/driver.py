"""Replay a workload through a running cluster and record it in the metrics store.

Requests are submitted on the workload's schedule (`cluster.pacing`; the driver records how
late each was against its planned time, so a slow driver cannot pass for a slow cluster), and
each finished request is written with its client-side timestamps in batches. The run's config
carries the workload's spec, so the run can be replayed exactly. The run is marked complete
only when every request has ended and the replicas and router have flushed: a run cut short
(Ctrl-C, a killed driver) keeps what was recorded and reads as incomplete.

The replicas are the router's at each moment, not the deployment's at the start: an autoscaled
cluster adds and drains them during the run. Whether more requests may come goes to the router,
which passes it to every replica it holds and to each it adds later (sent again while Ray
restarts the router; a router restarted after hearing it passes nothing to replicas added then,
which keep a fresh replica's word: more may come)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import ray
from tqdm import tqdm

from cluster.client import ROUTER_RETRY_SECONDS, Client, Result
from cluster.connection import ACTOR_GONE
from cluster.deploy import Deployment
from cluster.pacing import send_on_schedule
from metrics.recording import request_row
from protocol.errors import OverloadedError, SlotServeError
from workloads.workload import Workload, WorkloadRequest, request_prompt

REQUEST_BATCH = 32  # request rows per store write

logger = logging.getLogger(__name__)


async def _replay(
    client: Client, workload: Workload, run_id: int, store, router, vocab_size: int, seed: int, progress: bool
) -> None:
    rows: list[dict] = []
    moves: list = []  # MigrationRecords of finished requests
    bar = tqdm(total=len(workload.requests), desc=workload.name, unit="req", disable=not progress)

    async def flush() -> None:
        batch, rows[:] = list(rows), []
        migrated, moves[:] = list(moves), []
        if batch:
            await store.add_requests.remote(run_id, batch)
        if migrated:
            await store.add_migrations.remote(run_id, migrated)

    async def send(i: int, spec: WorkloadRequest, planned: float) -> None:
        submitted = time.time()
        prompt = request_prompt(seed, i, spec, vocab_size)
        rid = f"run{run_id}-{i}"
        try:
            result = await client.agenerate(
                prompt,
                session_id=spec.session_id,
                request_id=rid,
                tenant=spec.tenant,
                max_tokens=spec.output_len,
                ignore_eos=True,
                priority=spec.priority,
            )
        except SlotServeError as err:  # refused: bad input or overload (counted as rejected), or lost
            reason = "rejected" if isinstance(err, (ValueError, OverloadedError)) else "error"
            result = Result(rid, None, submitted, finish_reason=reason, error=str(err), completion=time.time())
        trace = result.trace(
            spec.prompt_len, spec.output_len, spec.session_id, planned, submitted, spec.priority, spec.tenant
        )
        rows.append(request_row(trace))
        moves.extend(result.migrations)
        bar.update(1)
        if len(rows) >= REQUEST_BATCH:
            await flush()

    async def tell_router(arrivals_done: bool) -> None:
        """The word sent again while Ray restarts the router (it is restartable), for as long as
        a client's call would be; never raised out of the schedule, which has requests running."""
        deadline = time.monotonic() + ROUTER_RETRY_SECONDS
        while True:
            try:
                await router.set_arrivals_done.remote(arrivals_done)
                return
            except ACTOR_GONE as err:
                if time.monotonic() > deadline:
                    logger.warning("the router did not hear arrivals_done=%s: %s", arrivals_done, err)
                    return
            await asyncio.sleep(0.5)

    try:
        await send_on_schedule(workload, send, tell_router)
    finally:
        await flush()  # keep what finished, even when cut short
        bar.close()


def run_workload(
    deployment: Deployment,
    workload: Workload,
    *,
    name: str,
    config: dict,
    batching_policy: str,
    routing_policy: str,
    seed: int = 0,
    slo: dict | None = None,
    progress: bool = True,
    client_routing: str = "actor",
) -> int:
    """Replay `workload` and return its run id in the store. `client_routing="local"`: the
    driver's client routes on its own (`cluster.local_routing`) instead of asking the router."""
    store = deployment.store
    config = {**config, "workload_spec": workload.spec}
    run_id = ray.get(store.begin_run.remote(name, config, batching_policy, routing_policy, seed, slo))
    router = deployment.router

    def replicas() -> list:
        return list(ray.get(router.replicas.remote()).values())

    ray.get([a.set_run.remote(run_id) for a in [router, *replicas()]])
    vocab = ray.get(next(iter(deployment.replicas.values())).info.remote()).vocab_size
    with Client(routing=client_routing) as client:
        asyncio.run(_replay(client, workload, run_id, store, router, vocab, seed, progress))
    ray.get(router.flush.remote())
    for flushed in [r.flush.remote() for r in replicas()]:
        with contextlib.suppress(ray.exceptions.RayActorError):  # drained and stopped meanwhile
            ray.get(flushed)
    ray.get(store.end_run.remote(run_id, "complete"))
    return run_id
