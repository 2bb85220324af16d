"""Fixtures shared across test modules."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_vae, random_inception_weights, write_our_checkpoint

pytest_plugins = ("gpu",)  # the cuda marker: skipped without a device, the CPU in the dry run (tests/gpu.py)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One OpenMP thread, as torchrun gives each rank: tiny tensors run far faster than with 2 spinning
    threads on a shared 2-core machine, and CPU convolutions round the same way in every process."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(autouse=True, scope="session")
def peak_cache(tmp_path_factory):
    """Measured CPU peaks are kept in a temp folder (subprocesses inherit it), not the user's ~/.cache."""
    saved = os.environ.get("DIT_CACHE_DIR")
    os.environ["DIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if saved is None:
        os.environ.pop("DIT_CACHE_DIR", None)
    else:
        os.environ["DIT_CACHE_DIR"] = saved


@pytest.fixture(scope="module")
def read_only(tmp_path_factory):
    """A folder nobody can write: a read-only tmpfs (root ignores a 0555 mode), or 0555 for another user."""
    folder = tmp_path_factory.mktemp("read_only")
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"root cannot mount a read-only tmpfs here ({mounted.stderr.decode().strip()})")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("vae")
    build_tiny_vae(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def our_ckpt(tmp_path_factory, vae_dir) -> Path:
    return write_our_checkpoint(tmp_path_factory.mktemp("run"), vae_dir)


@pytest.fixture(scope="session")
def inception_weights(tmp_path_factory) -> str:
    return random_inception_weights(tmp_path_factory.mktemp("inception") / "random-inception.pth")
