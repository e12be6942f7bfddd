"""The machine's two roofs, measured where the numbers are used: matrix-product FLOP/s (fp32 and
bf16) and memory bandwidth, and what they allow the model in tokens/s.

Why: a "% of roofline" is only meaningful against the machine that ran the step. Machines of one
kind differ (AVX2-only EPYCs and AVX-512 BF16 ones both occur), so `slotserve bench` probes at its
start (about 10 s) rather than reading a figure measured elsewhere; `benchmarks/hardware.py` uses
the same probes at more repetitions.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from protocol.cpu import cpu_info

BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def timed(fn, warmup: int, reps: int) -> list[float]:
    """Seconds per call of fn, after warmup calls (first calls pay for allocation and caches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def matmul_flops(dtype: torch.dtype, n_max: int, reps: int) -> tuple[float, float, int]:
    """(best, median) FLOP/s of an n x n matrix product (2 n^3 FLOPs), and n. Without native
    bf16 instructions (AVX-512 BF16, AMX) torch takes a slow path, so n is cut (down to 256)
    until one product is expected to take under half a second."""
    small = torch.ones(256, 256, dtype=dtype)
    probe, n = min(timed(lambda: small @ small, 1, 3)), n_max
    while n > 256 and probe * (n / 256) ** 3 > 0.5:
        n //= 2
    a, b, c = (torch.randn(n, n).to(dtype) for _ in range(3))
    times = timed(lambda: torch.matmul(a, b, out=c), 2, reps)
    return 2 * n**3 / min(times), 2 * n**3 / statistics.median(times), n


def bandwidth(nbytes: int, reps: int) -> dict[str, float]:
    """Best bytes/s of copying a tensor far larger than the caches (read + write bytes
    counted) and of summing it (read only, like a decode step streaming the weights)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return {
        "copy": 2 * nbytes / min(timed(lambda: dst.copy_(src), 2, reps)),
        "read": nbytes / min(timed(lambda: src.sum(), 2, reps)),
    }


@dataclass(frozen=True)
class Roofline:
    """This machine's roofs (best of the probe's repetitions) and its CPU."""

    cpu: str
    flags: str
    threads: int
    fp32_flops: float
    bf16_flops: float
    copy_bytes_per_s: float
    read_bytes_per_s: float

    def flops(self, dtype: str) -> float:
        return self.bf16_flops if dtype == "bfloat16" else self.fp32_flops

    def compute_tokens_per_s(self, params_per_token: int, dtype: str) -> float:
        """Decode tokens/s if every step ran at the matrix-product peak (2 FLOPs per weight)."""
        return self.flops(dtype) / (2 * params_per_token)

    def memory_tokens_per_s(self, params_per_token: int, dtype: str) -> float:
        """Batch-1 decode tokens/s if a step only had to read its weights once."""
        return self.read_bytes_per_s / (BYTES[dtype] * params_per_token)

    def best(self, other: Roofline) -> Roofline:
        """Each roof the higher of two probes of this machine (a roof is the most it gave)."""
        return replace(
            self,
            fp32_flops=max(self.fp32_flops, other.fp32_flops),
            bf16_flops=max(self.bf16_flops, other.bf16_flops),
            copy_bytes_per_s=max(self.copy_bytes_per_s, other.copy_bytes_per_s),
            read_bytes_per_s=max(self.read_bytes_per_s, other.read_bytes_per_s),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def probe(quick: bool = True) -> Roofline:
    """Measure the roofs here: ~10 s quick (as `slotserve bench` does), ~1 minute otherwise."""
    reps = 4 if quick else 15
    info = cpu_info()
    fp32 = matmul_flops(torch.float32, 1024 if quick else 2048, reps)
    bf16 = matmul_flops(torch.bfloat16, 1024 if quick else 2048, reps)
    bw = bandwidth((128 if quick else 256) * 2**20, 2 * reps)
    return Roofline(info.model, info.shown_flags, torch.get_num_threads(), fp32[0], bf16[0], bw["copy"], bw["read"])
