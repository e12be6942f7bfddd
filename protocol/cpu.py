"""What this CPU is and which matrix units it has, read from /proc/cpuinfo (no torch).

Why: machines of one kind differ (AVX2-only EPYCs and AVX-512 ones with AVX512_BF16 both
occur), and the right dtype, like every roofline figure, depends on which one runs the engine;
every run the store records names its CPU for the same reason. Here in the bottom layer because
the engine, the store and the benchmarks all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

UNKNOWN_CPU = "unknown CPU"  # the model of a CPU /proc/cpuinfo does not name

# Instructions that make bf16 matrix products fast (AVX-512 BF16 dot products, AMX tiles).
FAST_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# The flags worth printing next to a measurement (the rest do not change a matrix product).
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]
    cores: int

    @property
    def fast_bf16(self) -> bool:
        return bool(FAST_BF16_FLAGS & self.flags)

    @property
    def shown_flags(self) -> str:
        return " ".join(f for f in SHOWN_FLAGS if f in self.flags) or "none of " + " ".join(SHOWN_FLAGS)

    def describe(self) -> str:
        return f"{self.model}, {self.cores} cores, flags: {self.shown_flags}"


def parse_cpuinfo(text: str) -> CpuInfo:
    """CpuInfo from the text of /proc/cpuinfo (the first processor's model and flags)."""
    lines = text.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), UNKNOWN_CPU)
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    cores = sum(1 for ln in lines if ln.startswith("processor")) or 1
    return CpuInfo(model, frozenset(flags), cores)


def cpu_info(path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CPU (an unknown one, with no flags, where /proc/cpuinfo is missing)."""
    try:
        return parse_cpuinfo(Path(path).read_text())
    except OSError:
        return CpuInfo(UNKNOWN_CPU, frozenset(), 1)
