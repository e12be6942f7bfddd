"""Traffic as plain data: arrival times and prompt/output lengths, seeded and named.

Every workload is built from a serialisable spec (`workloads.spec`) that travels with it, and
replayed through one `ArrivalSchedule`. Nothing here imports the engine or Ray; a workload is
read by the engine scripts, the cluster driver and the simulator alike."""

from workloads.arrivals import (
    AllAtOnce,
    ArrivalProcess,
    BurstProfile,
    BurstyArrivals,
    ClosedLoopArrivals,
    GammaArrivals,
    PoissonArrivals,
    burst_profile,
    mean_rate_factor,
)
from workloads.lengths import FixedLength, LengthDist, LognormalLength, MixtureLength, UniformLength
from workloads.schedule import ArrivalSchedule
from workloads.spec import TraceSpec, WorkloadSpec, parse_spec
from workloads.standard import STANDARD_SPECS, at_load, bursty_mix, long_prompts, saturated, sigma_sweep, standard_spec
from workloads.traces import TraceError, read_azure_csv, read_mooncake_jsonl, read_trace
from workloads.workload import ClosedLoop, Workload, WorkloadRequest, prompt_token_ids

__all__ = [
    "AllAtOnce",
    "ArrivalProcess",
    "ArrivalSchedule",
    "BurstProfile",
    "BurstyArrivals",
    "ClosedLoop",
    "ClosedLoopArrivals",
    "FixedLength",
    "GammaArrivals",
    "LengthDist",
    "LognormalLength",
    "MixtureLength",
    "PoissonArrivals",
    "STANDARD_SPECS",
    "TraceError",
    "TraceSpec",
    "UniformLength",
    "Workload",
    "WorkloadRequest",
    "WorkloadSpec",
    "at_load",
    "burst_profile",
    "bursty_mix",
    "long_prompts",
    "mean_rate_factor",
    "parse_spec",
    "prompt_token_ids",
    "read_azure_csv",
    "read_mooncake_jsonl",
    "read_trace",
    "saturated",
    "sigma_sweep",
    "standard_spec",
]
