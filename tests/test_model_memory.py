"""What a replica's model holds in memory: the K/V cache on huge pages where the system gives
them on request, the skinny kernel's weight copies as one buffer, and, once loaded, no view of
the checkpoint file beside its own copies."""

from __future__ import annotations

import mmap
import os
import re
import shutil

import pytest
import torch

from replica.config import EngineConfig


def _thp_eligible_kb(lo: int, hi: int) -> tuple[int, int]:
    """(kB of the mappings overlapping [lo, hi), kB of those the kernel may back with huge pages)."""
    size = eligible = 0
    overlaps, vma_kb = False, 0
    for line in open("/proc/self/smaps").read().splitlines():
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            start, end = int(m.group(1), 16), int(m.group(2), 16)
            overlaps, vma_kb = start < hi and end > lo, (end - start) // 1024
            size += vma_kb if overlaps else 0
        elif overlaps and line.startswith("THPeligible:") and line.split()[1] == "1":
            eligible += vma_kb
    return size, eligible


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    or "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read(),
    reason="no transparent huge pages on this system",
)
def test_the_kv_cache_is_eligible_for_huge_pages_and_zeroed():
    """The K/V cache (every layer's K and V, one buffer) asks the kernel for transparent huge pages
    before its first write: all but the ragged ends of its memory are eligible for them, which
    plain tensors of the same size are not where the system gives huge pages only on request."""
    from replica.model.kv_cache import SlotKVCache
    from replica.model.memory import HUGE_PAGE

    cache = SlotKVCache(4, 16, 2048, 2, 64, torch.bfloat16)
    assert all(float(t.abs().sum()) == 0 for t in cache.k + cache.v)
    lo, hi = cache.k[0].data_ptr(), cache.v[-1].data_ptr() + cache.v[-1].numel() * 2
    size, eligible = _thp_eligible_kb(lo, hi)
    assert size >= (hi - lo) // 1024 and eligible >= (hi - lo - 2 * HUGE_PAGE) // 1024
    if "[madvise]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read():
        # fresh memory of the same size that never asked (a tensor from the heap might reuse
        # memory an earlier buffer in this process asked for)
        plain = torch.frombuffer(mmap.mmap(-1, hi - lo), dtype=torch.uint8)
        assert _thp_eligible_kb(plain.data_ptr(), plain.data_ptr() + plain.numel())[1] == 0


@pytest.mark.skipif(not shutil.which("c++"), reason="no C++ compiler: the skinny kernel is not built")
def test_a_loaded_models_skinny_copies_are_one_buffer_in_the_order_a_step_reads_them(tiny_qwen2_dir, monkeypatch):
    """The decoder gathers the skinny kernel's copies (taken here whatever this machine measures)
    into one buffer: each layer's qkv, o, up and down projections in turn, then the LM head, each
    starting where the one before it ends, so a step of few rows reads them as one stream."""
    from replica.model import linear
    from replica.model.runner import ModelRunner

    monkeypatch.setattr(linear, "crossover", lambda path, lin, fast: linear.CROSSOVER_ROWS[-1])
    model = ModelRunner(EngineConfig(model=tiny_qwen2_dir, dtype="float32", num_slots=2, max_seq_len=64)).model
    order = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.up, layer.down)] + [
        model.linear["lm_head"]
    ]
    held = [m.skinny_weight.data for m in order]
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    for a, b in zip(held, held[1:]):
        end = a.data_ptr() + a.numel() * a.element_size()
        assert end <= b.data_ptr() < end + linear._ALIGN_BYTES


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="no /proc: cannot see the process's mappings")
def test_a_loaded_model_keeps_no_view_of_its_checkpoint_file(tiny_qwen2_dir):
    """The runner copies every weight it keeps out of the loaded model (into its own layouts, or
    a copy of its own for the embeddings and norms), so once built it maps no checkpoint file:
    a view into the file's memory map would keep the whole file resident for the replica's life,
    beside the copies."""
    from replica.model.runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=tiny_qwen2_dir, dtype="float32", num_slots=2, max_seq_len=64))
    mapped = open("/proc/self/maps").read()
    assert runner.model.w["embed"].shape[0] > 0 and str(tiny_qwen2_dir) not in mapped
