"""What one engine replica is made of: the model, its dtype and device, the batching policy and
the scheduler's limits. One validated object that the engine, the model runner and the
cluster's replica config all take whole."""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator

from protocol import defaults
from protocol.cpu import CpuInfo, cpu_info
from replica.model.loader import DEFAULT_MODEL
from replica.scheduling.policies import POLICIES
from replica.scheduling.scheduler import SchedulerConfig


class EngineConfig(SchedulerConfig):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(DEFAULT_MODEL, description="built-in name or a local Hugging Face directory")
    policy: str = Field("continuous", description="batching policy (see replica.scheduling.policies.POLICIES)")
    dtype: defaults.Dtype = Field(
        defaults.DTYPE, description='"auto": bfloat16 on a GPU or a CPU with bf16 matrix units, else float32'
    )
    device: str = Field("auto", description='"auto" (cuda when present), "cpu" or "cuda"')
    int8_rows: int = Field(
        0, ge=0, description="CPU: steps of at most this many rows use weight-only int8 copies (0: none)"
    )
    fused_ops: bool = Field(
        True,
        description="CPU: RMSNorm, RoPE with the K/V write, SiLU-times-up and the sampler's greedy argmax as C++"
        " kernels where built",
    )
    decode_kernel: bool = Field(True, description="CPU: decode rows' attention through the C++ kernel where built")
    # A plain copy beside the packed one costs about the layers' weight bytes again, for the layers
    # where the kernel was measured faster.
    skinny_matmul: bool = Field(
        True,
        description="CPU: steps of a few rows through the C++ skinny kernel where measured faster; keeps a plain"
        " copy of each such layer weight beside the packed one (about the weights' bytes again)",
    )
    seed: int = 0

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        return POLICIES.check(policy)


def resolve_dtype(dtype: str, device: str, cpu: CpuInfo | None = None) -> str:
    """The dtype "auto" stands for on `device` ("cpu" or "cuda..."): bfloat16 on a GPU, and on a CPU
    with bf16 matrix units (AVX512_BF16 or AMX), where slotserve's bench measured bf16 faster
    than fp32 (HARDWARE.md); float32 on any other CPU, where bf16 products take a slow path.
    An explicit dtype is kept."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if (cpu or cpu_info()).fast_bf16 else "float32"
