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
since the replica's last item, and a request's last item comes after its last step. For the
same reason whether more requests may come (which a static batch waits on) goes through a small
actor, `ArrivalsFlag`, on which every replica keeps one call waiting for the next change.

Autoscaled by Serve's own autoscaler (`ServeBaseline(autoscale=...)`, an experiment cell routed
by a Serve router and sized by the `target_ongoing` policy, which is Serve's rule): the policy's
parameters become the deployment's `autoscaling_config` (`serve_autoscaling_config`) and the
drain timeout its graceful shutdown. Its replica-seconds are counted as slotserve's are
(`experiments.scaling_report.replica_timeline`): every decision period the run samples how many
replicas Serve's controller has starting, running and stopping, and each change goes to the
store's `scaling` table as a `ScalingDecision` of policy `ray_serve` (`current` and `desired`:
the replicas starting or running before and after it), so a replica counts from when Serve
starts it to when it has stopped, to within one period, as slotserve's do from their decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from autoscaling.policies import AutoscaleConfig, TargetOngoingParams
from cluster.pacing import send_on_schedule
from metrics.definitions import RequestTrace
from metrics.recording import request_row
from protocol.finish import FinishReason
from protocol.records import StepRecord
from protocol.scaling import ScalingDecision
from replica.serving.loop import AsyncEngine, ReplicaConfig, build_engine
from workloads.workload import Workload, WorkloadRequest, request_prompt

logger = logging.getLogger(__name__)

APP_NAME = "slotserve-serve-baseline"
_PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
SERVE_ROUTERS = {
    "serve_power_of_two": None,  # Serve's default router
    "serve_prefix_cache": _PREFIX_ROUTER,
}
_TOKEN_CHAR_BASE = 0x100  # token id t travels as chr(0x100 + t): printable, below the surrogates
SERVE_AUTOSCALER = "ray_serve"  # the policy named on the scaling rows a Serve-autoscaled run records
SERVE_POLICY = "target_ongoing"  # the autoscaling policy whose rule Serve's autoscaler is
# Serve's replica states, as slotserve's replicas' (starting, serving, draining) are counted
_STARTING = ("STARTING", "UPDATING", "RECOVERING")
_SERVING = ("RUNNING", "PENDING_MIGRATION")
_DRAINING = ("STOPPING",)


def serve_autoscaling_config(config: AutoscaleConfig) -> dict:
    """Serve's `autoscaling_config` for a `target_ongoing` policy: the same bounds, target,
    delays and look-back, its replicas reporting their ongoing requests every decision period
    (Serve's `metrics_interval_s`, deprecated in favour of environment variables read at import,
    which a running driver cannot set for itself). Serve has no cooldown: `cooldown_s` is unused."""
    if config.policy != SERVE_POLICY:
        raise ValueError(f"Ray Serve's autoscaler is the {SERVE_POLICY!r} rule, not {config.policy!r}")
    p = TargetOngoingParams(**config.params)
    return {
        "min_replicas": config.min_replicas,
        "initial_replicas": config.min_replicas,
        "max_replicas": config.max_replicas,
        "target_ongoing_requests": p.target_ongoing_requests,
        "upscale_delay_s": p.upscale_delay_s,
        "downscale_delay_s": p.downscale_delay_s,
        "look_back_period_s": p.look_back_s,
        "metrics_interval_s": config.period_s,
    }


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


@ray.remote(num_cpus=0)
class ArrivalsFlag:
    """Whether more requests may come before a running one ends, as the driver last said, for
    replicas it cannot address one by one: each keeps a call to `changed` waiting."""

    def __init__(self):
        self.done = False
        self._change = asyncio.Event()

    async def set(self, done: bool) -> None:
        if done != self.done:
            self.done = done
            self._change.set()
            self._change = asyncio.Event()

    async def changed(self, seen: bool) -> bool:
        """The value, once it differs from `seen`."""
        while self.done == seen:
            await self._change.wait()
        return self.done


class EngineDeployment:
    """One Serve replica: the replica engine's serving loop, streaming each step's tokens with
    the step records not yet sent, and following the driver's `ArrivalsFlag` (see the module
    docstring)."""

    def __init__(self, config: dict, arrivals: ActorHandle):
        from ray import serve

        self.replica_id = f"serve-{serve.get_replica_context().replica_id.unique_id}"
        self.serving = AsyncEngine(
            build_engine(ReplicaConfig.model_validate(config)), self._on_step, replica_id=self.replica_id
        )
        self.unsent: list[StepRecord] = []
        self._arrivals = arrivals
        self._following: asyncio.Task | None = None  # started on the serving loop, at the first request

    def _on_step(self, record: StepRecord) -> None:
        self.unsent.append(record)

    async def _follow_arrivals(self) -> None:
        done = False
        while True:
            done = await self._arrivals.changed.remote(done)
            self.serving.set_arrivals_done(done)

    async def __call__(self, request: ServeRequest) -> AsyncIterator[ServedChunk]:
        if self._following is None:
            self._following = asyncio.get_running_loop().create_task(self._follow_arrivals())
        params = {"max_tokens": request.max_tokens, "ignore_eos": True}
        async for out in self.serving.generate(request.token_ids, params, request.request_id, request.arrival):
            reason = out.finish_reason.value if isinstance(out.finish_reason, FinishReason) else None
            steps, self.unsent = self.unsent, []
            yield ServedChunk(self.replica_id, len(out.new_token_ids), reason, steps)


class ServeBaseline:
    """The replica engine deployed on Ray Serve (no HTTP proxy) with `num_replicas` replicas
    routed by `router` (a key of SERVE_ROUTERS, with `router_kwargs` for its
    `initialize_state`, e.g. the prefix router's `imbalanced_threshold`), recording into
    `store` (a `cluster.store_actor.StoreActor`); with `autoscale` (a `target_ongoing` policy)
    Serve's autoscaler sizes it instead, from `autoscale.min_replicas`. Started on creation;
    `shutdown()` stops it."""

    def __init__(
        self,
        config: ReplicaConfig,
        num_replicas: int,
        router: str,
        store,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        router_kwargs: dict | None = None,
        autoscale: AutoscaleConfig | None = None,
    ):
        from ray import serve
        from ray.serve.config import AutoscalingConfig, RequestRouterConfig

        self.config, self.router, self.store, self.router_kwargs = config, router, store, router_kwargs or {}
        self.autoscale = autoscale
        self.arrivals = ArrivalsFlag.remote()
        options = {}
        if SERVE_ROUTERS[router] is not None:
            options["request_router_config"] = RequestRouterConfig(
                request_router_class=SERVE_ROUTERS[router], request_router_kwargs=self.router_kwargs
            )
        if autoscale is None:
            options["num_replicas"] = num_replicas
        else:
            with warnings.catch_warnings():  # metrics_interval_s's deprecation (see serve_autoscaling_config)
                warnings.simplefilter("ignore", DeprecationWarning)
                options["autoscaling_config"] = AutoscalingConfig(**serve_autoscaling_config(autoscale))
            options["graceful_shutdown_timeout_s"] = autoscale.drain_timeout_s
        app = (
            serve.deployment(EngineDeployment)
            .options(
                name="engine",
                max_ongoing_requests=config.max_queue,
                ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
                **options,
            )
            .bind(config.model_dump(), self.arrivals)
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
        ray.get(self.arrivals.set.remote(False))
        start = time.time()
        period = None if self.autoscale is None else self.autoscale.period_s
        traces, steps, scaling = asyncio.run(_replay(self.handle, self.arrivals, workload, seed, vocab_size, period))
        if scaling:
            ray.get(self.store.add_scaling_records.remote(run_id, scaling, []))
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
        ray.kill(self.arrivals)


def _replica_counts() -> dict[str, int]:
    """How many replicas of the engine deployment Serve's controller has starting, serving and
    stopping (as slotserve's `starting`, `serving`, `draining`)."""
    from ray import serve

    states = serve.status().applications[APP_NAME].deployments["engine"].replica_states
    by_name = {str(getattr(state, "value", state)): n for state, n in states.items()}
    kinds = {"serving": _SERVING, "starting": _STARTING, "draining": _DRAINING}
    return {kind: sum(by_name.get(name, 0) for name in names) for kind, names in kinds.items()}


async def _sample_replicas(period: float, changes: list[ScalingDecision]) -> None:
    """Every `period` seconds until cancelled: Serve's replica counts, appended to `changes` as a
    `ScalingDecision` whenever they differ from the last sample (see the module docstring). A
    sample that fails (the controller busy or restarting) is logged and skipped: the timeline
    loses one point, the run none of its requests."""
    last: dict[str, int] | None = None
    while True:
        try:
            counts = await asyncio.to_thread(_replica_counts)
        except Exception:  # noqa: BLE001 - any failed read is one missing sample
            logger.warning("reading Ray Serve's replica counts failed; sample skipped", exc_info=True)
            counts = last
        if counts is not None and counts != last:
            before = counts if last is None else last
            reason = f"Ray Serve's controller: {counts['serving']} running, {counts['starting']} starting, "
            reason += f"{counts['draining']} stopping"
            inputs = {k: float(v) for k, v in counts.items()}
            current, desired = (c["serving"] + c["starting"] for c in (before, counts))
            changes.append(ScalingDecision(time.time(), SERVE_AUTOSCALER, current, desired, reason, inputs))
            last = counts
        await asyncio.sleep(period)


async def _replay(
    handle, arrivals: ActorHandle, workload: Workload, seed: int, vocab_size: int, sample_every: float | None = None
) -> tuple[list[RequestTrace], dict[str, list[StepRecord]], list[ScalingDecision]]:
    """Each request sent on the workload's schedule (`cluster.pacing`), tokens stamped on arrival
    here; returns the traces, each replica's step records that came with them and, sampling
    Serve's replicas every `sample_every` seconds (None: not), their changes."""
    stream = handle.options(stream=True)
    traces: list[RequestTrace] = []
    steps: dict[str, list[StepRecord]] = {}

    async def send(i: int, spec: WorkloadRequest, planned: float) -> None:
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
                priority=spec.priority,  # recorded for the reports' split by class: Serve schedules by neither
                tenant=spec.tenant,
            )
        )

    async def tell_replicas(arrivals_done: bool) -> None:
        await arrivals.set.remote(arrivals_done)

    scaling: list[ScalingDecision] = []
    sampler = None if sample_every is None else asyncio.ensure_future(_sample_replicas(sample_every, scaling))
    try:
        await send_on_schedule(workload, send, tell_replicas)
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    return traces, steps, scaling
