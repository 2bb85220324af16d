"""The host's memory: what a process may have, and two ``mallopt`` calls that keep what glibc frees, so that a CPU
step stops page-faulting (docs/performance.md), at the cost of keeping the peak heap."""

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
