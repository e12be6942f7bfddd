"""Where the model's large buffers come from, and how freed memory goes back to the system.

Huge pages. The model's large buffers are read in long streams or at scattered places on every step
(the weights a decode step streams once, the K/V its attention reads), and on 4 KiB pages nearly
every page they touch costs a TLB miss, whose page walk is dearer still in a virtual machine; on
2 MiB pages a whole matrix is a few entries. Where the system gives huge pages only on request
(`/sys/kernel/mm/transparent_hugepage/enabled` set to `madvise`, a common default), a tensor
gets them only if it asks before its memory is first written (`empty_on_huge_pages`).

Freed memory. Loading frees the source model and every weight copied into another layout, a
few hundred MB in pieces of a few MB, which glibc keeps for reuse that never comes: the replica
would hold them for its whole life (`return_freed_memory`)."""

from __future__ import annotations

import ctypes
import sys

import torch

# madvise(2)'s advice to back a range with transparent huge pages (Linux).
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 * 2**20


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """An uninitialised tensor whose memory the kernel is asked to back with huge pages (on Linux,
    on the CPU, where the system allows it on request; elsewhere a plain `torch.empty`). The advice
    covers the whole huge pages inside the tensor and may be refused: the tensor is the same."""
    t = torch.empty(shape, dtype=dtype, device=device)
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if t.device.type == "cpu" and sys.platform == "linux" and end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
    return t


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing)."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
