"""Ray Serve as the peer of slotserve's routing: the same replica engine (`replica.serving.loop`'s
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
its whole signal. What is recorded, through the same store actor as slotserve's runs: request
rows with client-side token times (the driver's clock) and each replica's step records, so a
run's prefix-cache hit rate and occupancy read the same; Serve's routers log no decisions, so
that table stays empty for its runs. Serve gives a caller no way to reach one chosen replica,
so a replica's step records ride on its token stream: each streamed item carries the steps run
since the replica's last item, and a request's last item comes after its last step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray

from metrics.definitions import RequestTrace
from metrics.recording import request_row
from replica.engine import StepRecord
from replica.scheduling.request import FinishReason
from replica.serving.loop import AsyncEngine, ReplicaConfig, build_engine
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


@dataclass(frozen=True)
class ServedChunk:
    """One streamed item: the tokens a step made for the request, and the replica's steps since
    its last item."""

    replica_id: str
    num_tokens: int
    finish_reason: str | None
    steps: list[StepRecord]


class EngineDeployment:
    """One Serve replica: the replica engine's serving loop, streaming each step's tokens with
    the step records not yet sent (see the module docstring)."""

    def __init__(self, config: dict):
        from ray import serve

        self.replica_id = f"serve-{serve.get_replica_context().replica_id.unique_id}"
        self.serving = AsyncEngine(
            build_engine(ReplicaConfig.model_validate(config)), self._on_step, replica_id=self.replica_id
        )
        self.unsent: list[StepRecord] = []

    def _on_step(self, record: StepRecord) -> None:
        self.unsent.append(record)

    async def __call__(self, request: ServeRequest) -> AsyncIterator[ServedChunk]:
        params = {"max_tokens": request.max_tokens, "ignore_eos": True}
        async for out in self.serving.generate(request.token_ids, params, request.request_id, request.arrival):
            reason = out.finish_reason.value if isinstance(out.finish_reason, FinishReason) else None
            steps, self.unsent = self.unsent, []
            yield ServedChunk(self.replica_id, len(out.new_token_ids), reason, steps)


class ServeBaseline:
    """The replica engine deployed on Ray Serve (no HTTP proxy) with `num_replicas` replicas
    routed by `router` (a key of SERVE_ROUTERS, with `router_kwargs` for its
    `initialize_state`, e.g. the prefix router's `imbalanced_threshold`), recording into
    `store` (a `cluster.store_actor.StoreActor`). Started on creation; `shutdown()` stops it."""

    def __init__(
        self,
        config: ReplicaConfig,
        num_replicas: int,
        router: str,
        store,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        router_kwargs: dict | None = None,
    ):
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        self.config, self.router, self.store, self.router_kwargs = config, router, store, router_kwargs or {}
        options = {}
        if SERVE_ROUTERS[router] is not None:
            options["request_router_config"] = RequestRouterConfig(
                request_router_class=SERVE_ROUTERS[router], request_router_kwargs=self.router_kwargs
            )
        app = (
            serve.deployment(EngineDeployment)
            .options(
                name="engine",
                num_replicas=num_replicas,
                max_ongoing_requests=config.max_queue,
                ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
                **options,
            )
            .bind(config.model_dump())
        )
        serve.start(proxy_location="Disabled")
        self.handle = serve.run(app, name=APP_NAME, route_prefix=None)

    def run_workload(
        self,
        workload: Workload,
        *,
        name: str,
        config: dict,
        batching_policy: str,
        seed: int = 0,
        vocab_size: int,
        slo: dict | None = None,
    ) -> int:
        """Replay `workload` (open loop, client-side token times) and record it as one run with
        Serve's router as its routing policy: request rows from here, step records from the
        replicas. Returns the run id."""
        config = {**config, "serve_router": self.router, "serve_router_kwargs": self.router_kwargs}
        config["workload_spec"] = workload.spec
        run_id = ray.get(self.store.begin_run.remote(name, config, batching_policy, self.router, seed, slo))
        start = time.time()
        traces, steps = asyncio.run(_replay(self.handle, workload, seed, vocab_size))
        slots = self.config.engine.num_slots
        writes = [
            self.store.add_step_records.remote(run_id, replica, slots, [r for r in records if r.start >= start])
            for replica, records in steps.items()
        ]
        rows = [request_row(t) for t in sorted(traces, key=lambda t: t.arrival)]
        ray.get([*writes, self.store.add_requests.remote(run_id, rows)])
        ray.get(self.store.end_run.remote(run_id, "complete"))
        return run_id

    def shutdown(self) -> None:
        from ray import serve

        serve.shutdown()


async def _replay(
    handle, workload: Workload, seed: int, vocab_size: int
) -> tuple[list[RequestTrace], dict[str, list[StepRecord]]]:
    """Each request sent at its planned time (open loop), tokens stamped on arrival here;
    returns the traces and each replica's step records that came with them."""
    schedule = ArrivalSchedule(workload)
    stream = handle.options(stream=True)
    traces: list[RequestTrace] = []
    steps: dict[str, list[StepRecord]] = {}
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
            async for chunk in stream.remote(ServeRequest(rid, ids, spec.output_len, arrival, token_text(ids))):
                replica = chunk.replica_id
                times += [time.time()] * chunk.num_tokens
                reason = chunk.finish_reason or reason
                steps.setdefault(replica, []).extend(chunk.steps)
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
    return traces, steps
