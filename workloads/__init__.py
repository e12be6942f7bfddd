"""Traffic as plain data: arrival times and prompt/output lengths, seeded and named.

Nothing here imports the engine or Ray; a workload is read by the engine scripts, the
cluster driver and the simulator alike."""

from workloads.standard import STANDARD_WORKLOADS, bursty_mix, long_prompts, saturated, sigma_sweep
from workloads.traces import TraceError, read_azure_csv, read_mooncake_jsonl
from workloads.workload import Workload, WorkloadRequest, prompt_token_ids

__all__ = [
    "STANDARD_WORKLOADS", "TraceError", "Workload", "WorkloadRequest", "bursty_mix", "long_prompts",
    "prompt_token_ids", "read_azure_csv", "read_mooncake_jsonl", "saturated", "sigma_sweep",
]
