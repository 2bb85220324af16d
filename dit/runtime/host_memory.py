"""The host's memory: how much a process may have, and keeping what it freed so a CPU step stops page-faulting.

PyTorch's CPU tensors come straight from glibc malloc. Blocks above the mmap threshold are mapped fresh
and unmapped on free, and freed memory at the top of the heap is trimmed back to the kernel, so every
step touches new pages for its activations and pays a page fault for each 4 KiB. On the 2-core CPU box
that was 7% of a DiT-S/2 fp32 step (1.6 M minor faults in 16 steps; docs/performance.md). Intel's CPU
guide prescribes jemalloc or tcmalloc through LD_PRELOAD for the same reason; two ``mallopt`` calls get
the same effect from inside the process, without a launcher or a package. The cost: the process keeps its
peak heap for its life, which a training or sampling process does anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from pathlib import Path

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_MAX = -4
_applied = False
# A container's memory limit (cgroup v2, then v1); "max" or a huge v1 number means none below the host's.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """The memory this host gives a process: its physical memory, or its container's limit where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in _CGROUP_LIMITS:
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def keep_freed_host_memory() -> bool:
    """Serve every allocation from the heap and never trim it; True where it took effect (glibc Linux)."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False  # musl, macOS and Windows allocators have no such knobs; nothing to do
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # -1 reaches glibc as SIZE_MAX (its value is a size_t): a threshold no free block ever exceeds.
    _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, -1))
    return _applied
