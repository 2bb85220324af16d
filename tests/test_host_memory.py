"""Freed host memory stays in the process, so a step's activations stop page-faulting in again."""

import mmap
import platform
import resource

import pytest
import torch

from dit.runtime.host_memory import keep_freed_host_memory

PAGE = mmap.PAGESIZE


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _faults_to_touch(numel: int) -> int:
    before = _minor_faults()
    torch.empty(numel).fill_(1.0)  # allocated, touched and freed
    return _minor_faults() - before


def _faults_of_a_fresh_block(nbytes: int) -> int:
    """What the bug costs here: a block mapped afresh and touched page by page, as untuned glibc serves one."""
    with mmap.mmap(-1, nbytes) as block:
        before = _minor_faults()
        for offset in range(0, nbytes, PAGE):
            block[offset] = 1
        return _minor_faults() - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's; elsewhere it reports False")
def test_repeated_large_allocations_stop_page_faulting():
    """Untuned, every 64 MiB block (above glibc's largest dynamic mmap threshold) is mapped afresh and faults
    like a fresh block each time; without the trim knob alone, the freed heap top goes back and comes in again.
    Tuned, the heap grows until the pattern fits (glibc's aligned allocations may not reuse a freed block at
    once; when, depends on the other allocations around, which a loaded machine moves), then the blocks come
    back from it without faults. So: most of 24 rounds fault not at all, against a measured fresh block."""
    nbytes = 64 * 2**20
    fresh = _faults_of_a_fresh_block(nbytes)
    if fresh < nbytes // PAGE // 2:
        pytest.skip(f"a fresh block faults {fresh} times here (huge pages): the bug is not visible")
    assert keep_freed_host_memory() and keep_freed_host_memory()  # idempotent
    faults = [_faults_to_touch(nbytes // 4) for _ in range(24)]
    like_fresh = [f for f in faults if f > fresh // 2]
    assert len(like_fresh) <= len(faults) // 2, (fresh, faults)
