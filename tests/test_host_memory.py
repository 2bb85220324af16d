"""Freed host memory stays in the process, so a step's activations stop page-faulting in again."""

import platform
import resource

import pytest
import torch

from dit.engine.host_memory import keep_freed_host_memory


def _faults_to_touch(numel: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(numel).fill_(1.0)  # allocated, touched and freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's; elsewhere it reports False")
def test_a_freed_block_is_reused_without_page_faults():
    numel = 64 * 2**20 // 4  # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB)
    assert keep_freed_host_memory() and keep_freed_host_memory()  # idempotent
    _faults_to_touch(numel)  # first touch of the heap pages
    assert _faults_to_touch(numel) < 0.05 * numel * 4 / 4096  # untuned: one fault per 4 KiB page, 16,384
