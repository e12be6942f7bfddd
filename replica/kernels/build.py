"""Builds a small C++ extension once with torch's extension tools, or says why it cannot.

Why here: the CPU kernels (`decode_attention`, `fused_ops`, `skinny_matmul`) are each a page of C++
(the `.cpp` file of the same name beside its Python wrapper) compiled for this CPU
(`-march=native`); the build (about 40 s each, cached under torch's extension directory) needs a
C++ compiler and ninja, which `make setup` checks. Where a build fails the engine keeps to torch's
own operators, so a machine without a compiler still serves.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch

from protocol.cpu import cpu_info

log = logging.getLogger(__name__)


def build(name: str, source: str, functions: list[str]) -> ModuleType | None:
    """The built module, or None where it cannot be built here (the reason is logged). The name
    carries a hash of the CPU's flags (`-march=native` code is one build per CPU kind, should the
    cache directory be shared) and of the torch install: each build writes its torch's include
    paths into its build file, so two environments sharing one name would rebuild each other's."""
    try:
        from torch.utils.cpp_extension import load_inline

        key = " ".join([*sorted(cpu_info().flags), torch.__file__])
        return load_inline(
            name=f"slotserve_{name}_{hashlib.sha1(key.encode()).hexdigest()[:8]}",
            cpp_sources=source,
            functions=functions,
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as err:  # noqa: BLE001 - no compiler or headers: callers keep to torch's operators
        log.warning("C++ extension %s not built (%s: %s); using torch's operators", name, type(err).__name__, err)
        return None


class CpuExtension:
    """One C++ extension of CPU kernels (`<name>.cpp` in this folder), built on first use (once per
    process)."""

    def __init__(self, name: str, functions: list[str]):
        self.name, self.functions = name, functions
        self.source_path = Path(__file__).with_name(f"{name}.cpp")

    @functools.cached_property
    def module(self) -> ModuleType | None:
        return build(self.name, self.source_path.read_text(), self.functions)

    def available(self, device: torch.device | str) -> bool:
        """Built here, and `device` is the CPU (the kernels run on CPU tensors only)."""
        return torch.device(device).type == "cpu" and self.module is not None
