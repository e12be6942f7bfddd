"""The standard workloads of docs/ARCHITECTURE.md as named, seeded specs (`STANDARD_SPECS`: name -> spec
factory), and the built workloads that tests and benchmarks replay."""

from __future__ import annotations

from collections.abc import Callable

from protocol.registry import Registry
from workloads.arrivals import AllAtOnce, BurstyArrivals, PoissonArrivals
from workloads.capacity import Capacity
from workloads.lengths import LognormalLength, MixtureLength, UniformLength
from workloads.prefixes import SharedPrefix
from workloads.spec import TenantsSpec, TenantTraffic, TraceSpec, WorkloadSpec
from workloads.workload import Workload

SIGMAS = (0.0, 0.4, 0.8, 1.2)

# bursty-mix's outputs: 70% short (4-32 tokens), 30% long (48-128).
SHORT_OR_LONG_OUTPUT = MixtureLength(
    components=((0.7, UniformLength(low=4, high=32)), (0.3, UniformLength(low=48, high=128)))
)


def saturated_spec(num_requests: int = 48, sigma: float = 0.8, median: float = 48, seed: int = 0) -> WorkloadSpec:
    """Everything arrives at t=0: prompts 16-64 tokens, outputs lognormal (median 48, clipped to [4, 256])."""
    return WorkloadSpec(
        name="saturated",
        seed=seed,
        num_requests=num_requests,
        arrivals=AllAtOnce(),
        prompt_len=UniformLength(low=16, high=64),
        output_len=LognormalLength(median=median, sigma=sigma, low=4, high=256),
        rng_layout="single",
    )


def sigma_sweep_spec(sigma: float = 0.8, num_requests: int = 48, seed: int = 0) -> WorkloadSpec:
    """One cell of the sigma sweep (run it with 8 slots, sigma in SIGMAS): saturated, output-length spread `sigma`."""
    return saturated_spec(num_requests, sigma=sigma, seed=seed).replace(name=f"sigma-sweep[{sigma}]")


def bursty_mix_spec(
    num_requests: int = 64,
    rate: float = 4.0,
    burst_factor: float = 3.0,
    period: float = 2.0,
    long_prompt_share: float = 0.0,
    long_prompt_len: int = 480,
    seed: int = 0,
) -> WorkloadSpec:
    """Bursty Poisson arrivals (base rate in requests/s); 70% short outputs (4-32), 30% long (48-128);
    prompts 8-64 tokens, or `long_prompt_len` for a `long_prompt_share` of requests; 8 sessions."""
    return WorkloadSpec(
        name="bursty-mix" if long_prompt_share == 0 else "long-prompts",
        seed=seed,
        num_requests=num_requests,
        arrivals=BurstyArrivals(rate=rate, burst_factor=burst_factor, period=period),
        prompt_len=UniformLength(low=8, high=64),
        output_len=SHORT_OR_LONG_OUTPUT,
        long_prompt_share=long_prompt_share,
        long_prompt_len=long_prompt_len,
        sessions=8,
    )


def long_prompts_spec(
    num_requests: int = 64, rate: float = 4.0, burst_factor: float = 3.0, period: float = 2.0, seed: int = 0
) -> WorkloadSpec:
    """bursty-mix with 15% prompts of 480 tokens: the prefill-stall case."""
    return bursty_mix_spec(num_requests, rate, burst_factor, period, long_prompt_share=0.15, seed=seed)


def heavy_tail_spec(
    num_requests: int = 200, rate: float = 4.0, burst_factor: float = 3.0, period: float = 2.0, seed: int = 0
) -> WorkloadSpec:
    """Bursty arrivals with heavy-tailed work: prompts lognormal (median 48, sigma 1.0, 8-320
    tokens) and outputs lognormal (median 24, sigma 1.2, 2-192), so one request can carry a
    hundred times another's work; fits a 512-token slot."""
    return WorkloadSpec(
        name="heavy-tail",
        seed=seed,
        num_requests=num_requests,
        arrivals=BurstyArrivals(rate=rate, burst_factor=burst_factor, period=period),
        prompt_len=LognormalLength(median=48, sigma=1.0, low=8, high=320),
        output_len=LognormalLength(median=24, sigma=1.2, low=2, high=192),
    )


def shared_prefix_spec(
    num_requests: int = 200,
    rate: float = 4.0,
    burst_factor: float = 3.0,
    period: float = 2.0,
    system_prompt_lens: tuple[int, ...] = (320, 288, 256, 224, 192, 160, 128, 96),
    zipf_s: float = 1.1,
    active_sessions: int = 16,
    turns: int = 4,
    seed: int = 0,
) -> WorkloadSpec:
    """Multi-turn chat on a few shared system prompts (`workloads.prefixes.SharedPrefix`):
    system prompts of the stated lengths picked by Zipf popularity, sessions of up to `turns`
    turns each extending the last; each turn's user message 16-48 tokens, its answer
    lognormal (median 24, sigma 1.0, 4-128); bursty arrivals; a turn's prompt and answer stay
    within 480 tokens. The eight system prompts (1,664 tokens) do not all fit in a replica's
    prefix cache beside its running requests at 8 slots x 512, so where a request goes matters."""
    return WorkloadSpec(
        name="shared-prefix",
        seed=seed,
        num_requests=num_requests,
        arrivals=BurstyArrivals(rate=rate, burst_factor=burst_factor, period=period),
        prompt_len=UniformLength(low=16, high=48),
        output_len=LognormalLength(median=24, sigma=1.0, low=4, high=128),
        shared_prefix=SharedPrefix(
            system_prompt_lens=system_prompt_lens,
            zipf_s=zipf_s,
            active_sessions=active_sessions,
            turns=turns,
            max_prompt_len=480,
        ),
    )


def kv_pressure_spec(
    num_requests: int = 300,
    rate: float = 4.0,
    groups: int = 16,
    prefix_len: int = 1024,
    zipf_s: float = 0.2,
    active_sessions: int = 32,
    turns: int = 2,
    seed: int = 0,
) -> WorkloadSpec:
    """Where the choice of replica decides whether a prefix is recomputed: `groups` shared
    prefixes of `prefix_len` tokens each (documents, long system prompts), near-uniform
    popularity (Zipf `zipf_s`), short sessions of up to `turns` turns; each turn's message
    16-48 tokens, its answer lognormal (median 24, sigma 1.0, 4-128); Poisson arrivals. Run it on
    replicas whose K/V budget holds a third or less of the prefixes while the cluster's total
    holds them all (16 x 1,024 tokens: about 5,600 K/V tokens per replica at 4 replicas), so a
    router that spreads each prefix over every replica keeps evicting and recomputing it."""
    return WorkloadSpec(
        name="kv-pressure",
        seed=seed,
        num_requests=num_requests,
        arrivals=PoissonArrivals(rate=rate),
        prompt_len=UniformLength(low=16, high=48),
        output_len=LognormalLength(median=24, sigma=1.0, low=4, high=128),
        shared_prefix=SharedPrefix(
            system_prompt_lens=(prefix_len,) * groups,
            zipf_s=zipf_s,
            active_sessions=active_sessions,
            turns=turns,
            max_prompt_len=prefix_len + 384,
        ),
    )


def zero_reuse_spec(num_requests: int = 300, rate: float = 4.0, seed: int = 0) -> WorkloadSpec:
    """kv-pressure's control: prompts of about its length (uniform 768-1,152 tokens) and its
    outputs, Poisson arrivals, and no shared prefix at all (every prompt is fresh tokens), so
    a prefix-aware policy has nothing to find and should route as well as a load-only one."""
    return WorkloadSpec(
        name="zero-reuse",
        seed=seed,
        num_requests=num_requests,
        arrivals=PoissonArrivals(rate=rate),
        prompt_len=UniformLength(low=768, high=1152),
        output_len=LognormalLength(median=24, sigma=1.0, low=4, high=128),
    )


def azure_conv_spec(
    num_requests: int = 200,
    seed: int = 0,
    time_scale: float = 1.0,
    length_scale: float = 0.05,
    every: int = 1,
    start_offset: float = 0.0,
) -> TraceSpec:
    """The first `num_requests` of the shipped Azure conversation trace (after `start_offset`
    seconds, every `every`-th), lengths x 0.05 by default (mean prompt about 58 tokens, mean
    output about 11) so it fits a small replica. A trace has no seed: `seed` must be 0."""
    if seed != 0:
        raise ValueError(f"seed: the azure-conv trace is fixed, sample it with every/start_offset (got seed {seed})")
    return TraceSpec(
        format="azure",
        name="azure-conv",
        limit=num_requests,
        time_scale=time_scale,
        length_scale=length_scale,
        every=every,
        start_offset=start_offset,
    )


def flood_spec(
    duration: float = 60.0,
    interactive_load: float = 0.25,
    batch_load: float = 0.35,
    flood_load: float = 2.5,
    seed: int = 0,
) -> TenantsSpec:
    """Flow control's traffic: an `interactive` tenant at steady load (priority 0, short prompts
    and outputs), a `batch` tenant (priority 2, long outputs) and a `flood` tenant sending at
    `flood_load` x capacity through the middle third, in the batch band: a runaway job of a
    non-critical tenant, so priority alone keeps it off the interactive class and fair share
    within the band is what keeps it off the batch tenant. Loads are x the cluster's capacity
    (at `at_load(1.0, capacity)`; a sweep's load scales all three)."""
    return TenantsSpec(
        name="flood",
        seed=seed,
        duration=duration,
        tenants=[
            TenantTraffic(
                name="interactive",
                priority=0,
                load=interactive_load,
                prompt_len=UniformLength(low=16, high=64),
                output_len=UniformLength(low=8, high=32),
            ),
            TenantTraffic(
                name="batch",
                priority=2,
                load=batch_load,
                prompt_len=UniformLength(low=32, high=128),
                output_len=UniformLength(low=128, high=256),
            ),
            TenantTraffic(
                name="flood",
                priority=2,
                load=flood_load,
                start=1 / 3,
                end=2 / 3,
                prompt_len=UniformLength(low=64, high=128),
                output_len=UniformLength(low=32, high=64),
            ),
        ],
    )


STANDARD_SPECS: Registry[Callable[..., WorkloadSpec | TraceSpec | TenantsSpec]] = Registry(
    "standard workload",
    {
        "saturated": saturated_spec,
        "sigma-sweep": sigma_sweep_spec,
        "bursty-mix": bursty_mix_spec,
        "long-prompts": long_prompts_spec,
        "azure-conv": azure_conv_spec,
        "heavy-tail": heavy_tail_spec,
        "shared-prefix": shared_prefix_spec,
        "kv-pressure": kv_pressure_spec,
        "zero-reuse": zero_reuse_spec,
        "flood": flood_spec,
    },
)


def standard_spec(name: str, **kwargs) -> WorkloadSpec | TraceSpec | TenantsSpec:
    """The standard workload `name` made with `kwargs` (the factory's arguments)."""
    return STANDARD_SPECS[name](**kwargs)


def saturated(*args, **kwargs) -> Workload:
    """`saturated_spec(...)`, built."""
    return saturated_spec(*args, **kwargs).build()


def sigma_sweep(*args, **kwargs) -> Workload:
    """`sigma_sweep_spec(...)`, built."""
    return sigma_sweep_spec(*args, **kwargs).build()


def bursty_mix(*args, **kwargs) -> Workload:
    """`bursty_mix_spec(...)`, built."""
    return bursty_mix_spec(*args, **kwargs).build()


def long_prompts(*args, **kwargs) -> Workload:
    """`long_prompts_spec(...)`, built."""
    return long_prompts_spec(*args, **kwargs).build()


def at_load(name: str, num_requests: int, load: float, capacity: Capacity | float, seed: int = 0, **shape) -> Workload:
    """The named standard workload with arrivals at `load` x a measured capacity
    (`workloads.capacity`; a bare number: decode tokens/s), built, with load and capacity in
    its params (see `WorkloadSpec.at_load`). `saturated` has no rate and comes back as it is."""
    spec = standard_spec(name, num_requests=num_requests, seed=seed, **shape)
    workload = spec.at_load(load, capacity).build()
    if spec.has_rate:
        workload.params.update({"load": load, **Capacity.of(capacity).as_params()})
    return workload
