"""The model's matrix products: y = x W^T + b, with W prepacked for oneDNN where that pays, a
copy in the skinny kernel's layout for steps of few rows, and an optional weight-only int8 copy.

Why: on these CPUs MKL's F.linear reaches a fraction of the machine on the skinny products of a
decode step (1-64 rows) and on the 49k-column LM head, while oneDNN with the weight reordered
once into its blocked layout reaches far more (HARDWARE.md, "What each optimisation bought"). It
is the kernel torch.compile's CPU freezing pass picks, without the compile. oneDNN packs fp32
weights on any x86 CPU and bf16 weights where the CPU has AVX-512 (with AVX512_BF16 or AMX it
uses them natively). On a GPU, or where oneDNN cannot pack, the plain F.linear is used.

A step with few rows is bound by reading the weights, not by arithmetic, and oneDNN's packed
product, tuned for larger steps, reads them well below the memory bandwidth at one row.
`replica.kernels.skinny_matmul`'s dense kernel reads a copy in its own layout at close to it (fp32
weights, and bf16 ones where the CPU has AVX512_BF16), with the same dtype and fp32 sums, so it
serves steps up to the row count where it was measured faster than the packed product on this
machine; a weight where it never pays keeps no such copy beside the packed one.

Reading a quarter of fp32's bytes (int8 with one scale per output row) can make such a step
faster still, at a cost in outputs; a Linear built with `int8_rows=N` keeps such a copy and uses
it for steps of at most N rows, through the skinny kernel's int8 product where it is built
(`aten._weight_int8pack_mm` otherwise). N is only the most it may serve: int8 serves steps up to
the row count where it beat the best dense path measured on this machine.

Both row counts are crossovers (`crossover`): a few seconds once per weight shape, CPU kind,
torch version and thread count, cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from protocol.cpu import cpu_info
from replica.kernels import skinny_matmul
from replica.model.loader import cache_dir
from replica.model.memory import empty_on_huge_pages, return_freed_memory

# The row count oneDNN tunes the packed layout for: a full decode batch of the default config.
PACK_ROWS_HINT = 64
# Row counts at which a path is timed against the one it would replace, in order, up to the first it loses.
CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64)
CROSSOVER_REPS = 5
# Read between timed calls so each finds its weights out of the caches, as a step does (it streams
# every layer's weights once): larger than this machine kind's L3 (32 MiB).
EVICT_BYTES = 64 * 2**20
# A path must beat the one it would replace by this factor to be used at a row count: on a noisy
# machine a tie goes to the path already there (oneDNN's, the most tried; dense, not int8).
CROSSOVER_MARGIN = 0.95
CROSSOVER_FILE = "crossover.json"


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packing exists for fp32 weights on a CPU build with mkldnn, and for bf16 ones where
    oneDNN has bf16 kernels for this CPU (AVX-512 and up)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: (int8 [N, K], scales [N] in the weight's dtype)."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(weight.dtype)


def can_int8(weight: torch.Tensor) -> bool:
    """`_weight_int8pack_mm` takes bf16 (or fp32) activations on the CPU."""
    return weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)


class Linear:
    """One weight matrix and its optional bias, called like F.linear. skinny: use the skinny
    kernel's dense product up to its measured crossover (off: no copy for it kept, the packed or
    plain product at every step the int8 copy does not serve). int8_rows: keep an int8 copy for
    steps of at most that many rows, fewer where `crossover` measured it slower here
    (`measure_int8=False` takes int8_rows as it is, as benchmarks of the int8 path do)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        pack: bool = True,
        int8_rows: int = 0,
        measure_int8: bool = True,
        skinny: bool = True,
    ):
        self.bias = bias
        self.shape, self.dtype = weight.shape, weight.dtype
        self.packed = pack and can_pack(weight)
        # The packed copy replaces the plain one; the skinny kernel's copy is kept only where it pays (a
        # shared tensor, like a tied embedding, stays alive elsewhere anyway).
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT) if self.packed else weight
        # Each faster path serves no rows while it is measured against the paths already there.
        self.skinny_rows = 0
        self.int8_rows = 0
        self.int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.int8_kernel = False
        serves = skinny and skinny_matmul.serves_dense(weight)
        self.skinny_weight = skinny_matmul.dense_layout(weight) if serves else None
        if self.skinny_weight is not None:
            dense = self.skinny_weight
            self.skinny_rows = crossover("skinny", self, lambda x: skinny_matmul.dense_linear(x, dense, bias))
            if not self.skinny_rows:
                self.skinny_weight = None  # never pays here: the packed copy alone is kept
        self.int8 = quantize_int8(weight) if int8_rows and can_int8(weight) else None
        if self.int8 is not None:
            self.int8_kernel = skinny_matmul.available(weight.device)
            self.int8_rows = min(int8_rows, crossover("int8", self, self.quantized)) if measure_int8 else int8_rows
            if not self.int8_rows:
                self.int8 = None  # never pays here: no copy kept
        if self.int8_rows >= self.skinny_rows:  # int8 serves every step the skinny copy would
            self.skinny_weight, self.skinny_rows = None, 0

    @property
    def paths(self) -> str:
        """The paths this Linear has, as its crossovers' cache keys name them."""
        dense = "packed" if self.packed else "plain"
        skinny = f"+skinny<={self.skinny_rows}" if self.skinny_rows else ""
        int8 = ("+int8 kernel" if self.int8_kernel else "+int8 aten") if self.int8 is not None else ""
        return dense + skinny + int8

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, K] W^T + b, plus `residual` [rows, N] where given (the skinny kernel and
        oneDNN's packed product add it in the product's own pass: the layer's residual adds cost no
        pass of their own). x is 2-D: the skinny and int8 paths take no leading dims."""
        rows = x.shape[0]
        if 0 < rows <= self.int8_rows:
            return self.quantized(x, residual)
        if 0 < rows <= self.skinny_rows:
            return skinny_matmul.dense_linear(x, self.skinny_weight, self.bias, residual)
        if self.packed and residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else y.add_(residual)

    def quantized(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The same product through the int8 copy, whatever the row count."""
        if self.int8_kernel:
            return skinny_matmul.int8_linear(x, *self.int8, self.bias, residual)
        y = torch.ops.aten._weight_int8pack_mm(x, *self.int8)
        if self.bias is not None:
            y += self.bias
        return y if residual is None else y.add_(residual)


# Where each skinny copy starts in the shared buffer: a whole cache line, as a tensor of its own would.
_ALIGN_BYTES = 64
# Moved copies are handed back to the system in batches of this many bytes: each trim walks the
# whole heap, and one at the end would hold every copy twice while the buffer fills.
_RETURN_EVERY_BYTES = 32 * 2**20


def gather_skinny_weights(linears: list[Linear]) -> None:
    """Move the skinny kernel's copies of `linears` into one buffer on huge pages, each after the
    one before it in the order given (the order a step reads them). Why: a step of few rows streams
    every weight once, matrix after matrix; as one stretch of memory on 2 MiB pages
    (`replica.model.memory`) the stream costs a few TLB entries instead of a miss per 4 KiB
    page, and the memory it reads next is the next matrix. The products are the same bit for bit:
    only where the values live changes. The moved copies go back to the system as the buffer fills
    (the last few with the loader's own trim), whose pages are taken only as it fills, so loading
    holds little more than one set of copies."""
    held = [linear for linear in linears if linear.skinny_weight is not None]
    if not held:
        return
    first = held[0].skinny_weight.data
    per_line = _ALIGN_BYTES // first.element_size()
    offsets, size = [], 0
    for linear in held:
        data = linear.skinny_weight.data
        if data.dtype != first.dtype or data.device != first.device:
            raise ValueError(f"skinny copies of one buffer share a dtype and device: {data.dtype} {data.device}")
        offsets.append(size)
        size += -(-data.numel() // per_line) * per_line
    buffer = empty_on_huge_pages((size,), first.dtype, str(first.device))
    freed = 0
    for linear, offset in zip(held, offsets):
        data, blocked = linear.skinny_weight.data, linear.skinny_weight.blocked
        moved = buffer[offset : offset + data.numel()].view(data.shape)
        moved.copy_(data)
        freed += data.numel() * data.element_size()
        linear.skinny_weight = skinny_matmul.DenseWeight(moved, blocked)
        del data  # its last reference: the copy is free now
        if freed >= _RETURN_EVERY_BYTES:  # the copies moved, else kept by the heap while the buffer fills
            return_freed_memory()
            freed = 0


def _median_seconds(fns: dict[str, Callable[[], torch.Tensor]], reps: int) -> dict[str, float]:
    """Median seconds of each call, each after reading `EVICT_BYTES` (untimed), taken in turns so
    a neighbour's burst hits each alike."""
    evict = torch.ones(EVICT_BYTES // 4)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps + 1):  # the first round warms up
        for name, fn in fns.items():
            evict.sum()
            t = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def _crossover_key(path: str, linear: Linear) -> str:
    info = cpu_info()
    flags = hashlib.sha1(" ".join(sorted(info.flags)).encode()).hexdigest()[:8]
    cpu = f"{info.model}/{info.cores} cores/{flags}"
    versions = f"torch {torch.__version__}/kernel {skinny_matmul.source_hash()}"
    threads, shape = torch.get_num_threads(), f"{linear.shape[0]}x{linear.shape[1]}"
    return f"{path}/{cpu}/{versions}/{threads} threads/{linear.dtype}/{shape}/{linear.paths}"


_CROSSOVERS: dict[str, int] = {}


def crossover(path: str, linear: Linear, fast: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """The most rows of `CROSSOVER_ROWS` up to which `fast(x)` beat `linear(x)` (the paths
    `linear` has so far) by `CROSSOVER_MARGIN` at every count measured (0: not even at one row),
    timed on this machine with random rows. Measured once per path, CPU kind, torch version,
    kernel source, thread count, dtype, weight shape and the paths it was timed against; kept in memory and in
    `cache_dir()`'s crossover.json, so the next start reads it."""
    key = _crossover_key(path, linear)
    file = cache_dir() / CROSSOVER_FILE
    if key not in _CROSSOVERS:
        try:
            _CROSSOVERS.update(json.loads(file.read_text()))
        except (OSError, ValueError):
            pass
    if key in _CROSSOVERS:
        return _CROSSOVERS[key]
    best = 0
    for rows in CROSSOVER_ROWS:
        x = torch.randn(rows, linear.shape[1]).to(linear.dtype)
        with torch.inference_mode():
            t = _median_seconds({"current": lambda: linear(x), "fast": lambda: fast(x)}, CROSSOVER_REPS)
        if t["fast"] > CROSSOVER_MARGIN * t["current"]:
            break
        best = rows
    _CROSSOVERS[key] = best
    try:  # written whole and renamed, so a reader never sees half a file
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=file.parent, delete=False, suffix=".tmp") as f:
            json.dump(_CROSSOVERS, f, indent=1, sort_keys=True)
        os.replace(f.name, file)
    except OSError:
        pass  # a read-only cache: measured again next start
    return best
