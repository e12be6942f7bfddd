"""Ray Serve as the peer of slotserve's routing: the same replica engine (`replica.serving`'s
AsyncEngine over `build_engine`, fake or real model) deployed as a Ray Serve deployment and
routed by Serve's own request routers, driven with a workload the way `cluster.driver` drives
slotserve, and recorded in the same store through `metrics.recording`.

Routers (`SERVE_ROUTERS`): `serve_power_of_two`, Serve's default (two replicas sampled, the one
with fewer ongoing requests taken), and `serve_prefix_cache`, Ray Serve LLM's
`PrefixCacheAffinityRouter` (a prefix tree of the prompt text each replica was sent; the
replica with the longest match while queues are within its imbalance threshold). The prefix
router reads a `prompt` attribute of the request as text, so a prompt of token ids travels as
`ServeRequest.prompt`, one character per token id: equal token prefixes are equal text prefixes.
It is imported from Ray's internal module because its public one (`ray.serve.llm`) needs vLLM
or SGLang installed; the class is the same.

Serve's replicas admit at most `max_ongoing_requests` at once and queue the rest at the
caller's handle; it is set to the engine's queue bound (`ReplicaConfig.max_queue`) so, as in
slotserve, requests wait in the engine's queue and the router's count of ongoing requests is
its whole signal. What is recorded: request rows with client-side token times (the driver's
clock); Serve exposes neither step records nor routing decisions, so those tables stay empty
for its runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve
from ray.serve.config import RequestRouterConfig

from metrics.definitions import RequestTrace
from metrics.recording import record_run
from replica.request import FinishReason
from replica.serving import AsyncEngine, ReplicaConfig, build_engine
from workloads.schedule import ArrivalSchedule
from workloads.workload import Workload, request_prompt

APP_NAME = "slotserve-serve-baseline"
_PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
SERVE_ROUTERS = {
    "serve_power_of_two": None,  # Serve's default router
    "serve_prefix_cache": _PREFIX_ROUTER,
}
_TOKEN_CHAR_BASE = 0x100  # token id t travels as chr(0x100 + t): printable, below the surrogates


@dataclass(frozen=True)
class ServeRequest:
    """One request as the Serve deployment takes it; `prompt` is the prompt as text for Serve's
    prefix router (see the module docstring)."""

    request_id: str
    token_ids: list[int]
    max_tokens: int
    arrival: float
    prompt: str


def token_text(token_ids: list[int]) -> str:
    return "".join(chr(_TOKEN_CHAR_BASE + t) for t in token_ids)


class EngineDeployment:
    """One Serve replica: the replica engine's serving loop, streaming each step's tokens."""

    def __init__(self, config: dict):
        self.replica_id = f"serve-{serve.get_replica_context().replica_id.unique_id}"
        self.serving = AsyncEngine(build_engine(ReplicaConfig.model_validate(config)), replica_id=self.replica_id)

    async def __call__(self, request: ServeRequest) -> AsyncIterator[tuple[str, int, float, str | None]]:
        """(replica id, new tokens, made at, finish reason or None) per step of the request."""
        params = {"max_tokens": request.max_tokens, "ignore_eos": True}
        async for out in self.serving.generate(request.token_ids, params, request.request_id, request.arrival):
            reason = out.finish_reason.value if isinstance(out.finish_reason, FinishReason) else None
            yield self.replica_id, len(out.new_token_ids), out.time, reason


def deploy(
    config: ReplicaConfig, num_replicas: int, router: str, num_cpus: float = 1.0, router_kwargs: dict | None = None
):
    """Start Serve (no HTTP proxy) with `num_replicas` engine replicas routed by `router` (a
    key of SERVE_ROUTERS, with `router_kwargs` for its `initialize_state`, e.g. the prefix
    router's `imbalanced_threshold`); returns the deployment's handle once every replica is up."""
    options = {}
    if SERVE_ROUTERS[router] is not None:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=SERVE_ROUTERS[router], request_router_kwargs=router_kwargs or {}
        )
    app = (
        serve.deployment(EngineDeployment)
        .options(
            name="engine",
            num_replicas=num_replicas,
            max_ongoing_requests=config.max_queue,
            ray_actor_options={"num_cpus": num_cpus},
            **options,
        )
        .bind(config.model_dump())
    )
    serve.start(proxy_location="Disabled")
    return serve.run(app, name=APP_NAME, route_prefix=None)


def shutdown() -> None:
    serve.shutdown()


async def _replay(handle, workload: Workload, seed: int, vocab_size: int) -> list[RequestTrace]:
    """Each request sent at its planned time (open loop), tokens stamped on arrival here."""
    schedule = ArrivalSchedule(workload)
    stream = handle.options(stream=True)
    traces: list[RequestTrace] = []
    wake = asyncio.Event()
    t0 = time.time()

    async def one(i: int, planned: float) -> None:
        spec = workload.requests[i]
        ids = request_prompt(seed, i, spec, vocab_size)
        arrival = time.time()
        rid = f"serve-{i}"
        times: list[float] = []
        replica, reason, error = None, "error", None
        try:
            async for served_by, count, _, finish in stream.remote(
                ServeRequest(rid, ids, spec.output_len, arrival, token_text(ids))
            ):
                replica = served_by
                times += [time.time()] * count
                reason = finish or reason
        except Exception as err:  # noqa: BLE001 - a failed request is recorded as one
            error = f"{type(err).__name__}: {str(err)[:200]}"
        finally:
            schedule.finished(i, time.time() - t0)
            wake.set()
        traces.append(
            RequestTrace(
                rid,
                arrival,
                times,
                time.time(),
                reason,
                spec.prompt_len,
                replica,
                session_id=spec.session_id,
                max_tokens=spec.output_len,
                error=error,
                planned_arrival=planned,
                submit_lateness=arrival - planned,
            )
        )

    tasks = []
    while True:
        for i, _, planned in schedule.due(time.time(), t0):
            tasks.append(asyncio.create_task(one(i, t0 + planned)))
        if schedule.done:
            break
        wake.clear()
        next_time = schedule.next_time()
        timeout = None if next_time is None else max(0.0, t0 + next_time - time.time())
        try:
            await asyncio.wait_for(wake.wait(), timeout)
        except TimeoutError:
            pass
    await asyncio.gather(*tasks)
    return traces


def run_workload(
    handle,
    workload: Workload,
    store,
    *,
    name: str,
    router: str,
    config: dict,
    batching_policy: str,
    seed: int = 0,
    vocab_size: int,
    slo: dict | None = None,
) -> int:
    """Replay `workload` through the Serve deployment and record it in `store` (a
    `metrics.store.MetricsStore`) with `router` as the run's routing policy; returns the run id."""
    traces = asyncio.run(_replay(handle, workload, seed, vocab_size))
    return record_run(
        store,
        name=name,
        config={**config, "serve_router": router, "workload_spec": workload.spec},
        batching_policy=batching_policy,
        routing_policy=router,
        seed=seed,
        traces=sorted(traces, key=lambda t: t.arrival),
        slo=slo,
    )
