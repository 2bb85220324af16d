"""Freed host memory stays in the process, so a step's activations stop page-faulting in again."""

import platform
import resource

import pytest
import torch

from dit.runtime.host_memory import keep_freed_host_memory


def _faults_to_touch(numel: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(numel).fill_(1.0)  # allocated, touched and freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's; elsewhere it reports False")
def test_repeated_large_allocations_stop_page_faulting():
    """Untuned, every 64 MiB block (above glibc's largest dynamic mmap threshold) is mapped afresh: 16,384
    faults each time. Tuned, the heap grows until the pattern fits (glibc's aligned allocations may not
    reuse a freed block at once), then the blocks come back from it without faults."""
    numel = 64 * 2**20 // 4
    assert keep_freed_host_memory() and keep_freed_host_memory()  # idempotent
    faults = [_faults_to_touch(numel) for _ in range(12)]
    assert sum(faults[-4:]) < 0.05 * numel * 4 / 4096, faults
