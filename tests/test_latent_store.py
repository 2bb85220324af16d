"""dit.data.store format and dit.data.reader, on synthetic moments (no VAE, no images)."""

import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dit.data.reader import LatentStoreDataset
from dit.data.store import (
    MANIFEST,
    StoreSpec,
    begin_store,
    finalize_store,
    read_header,
    shard_file,
    verify_store,
    write_manifest,
    write_moments_store,
    write_shard,
)
from dit.io.errors import UserError


def synthetic_moments(n, views=2, size=4, seed=0):
    """Moments [n, views, 2, 4, size, size]: random means, std in [0.2, 1]; view 1 = view 0 + 10, so a read
    can tell which view it came from."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, 1, 4, size, size, generator=g)
    std = 0.2 + 0.8 * torch.rand(n, 1, 4, size, size, generator=g)
    moments = torch.stack([mean, std], dim=2)
    if views == 2:
        moments = torch.cat([moments, moments + torch.tensor([10.0, 0.0]).view(1, 1, 2, 1, 1, 1)], dim=1)
    return moments


@pytest.fixture
def store(tmp_path):
    moments, labels = synthetic_moments(10), torch.arange(10) % 3
    write_moments_store(
        str(tmp_path), moments, labels, num_classes=3, scale=0.5, storage_dtype="fp32", shard_size=4
    )
    return str(tmp_path), moments, labels


def test_layout_manifest_and_deterministic_reads(store):
    path, moments, labels = store
    manifest = json.loads(Path(path, MANIFEST).read_text())
    assert manifest["complete"] and manifest["num_images"] == 10 and manifest["flips_stored"]
    assert [s["num_images"] for s in manifest["shards"]] == [4, 4, 2]
    assert sorted(os.listdir(path)) == sorted(
        [MANIFEST] + [shard_file(k) + ext for k in range(3) for ext in ("", ".sha256")]
    )
    header, _ = read_header(os.path.join(path, shard_file(2)))
    assert header["moments"]["shape"] == [2, 2, 2, 4, 4, 4] and header["moments"]["dtype"] == "F32"
    assert json.loads(header["__metadata__"]["dit_ledger"])["files"] == [
        "in-memory moments/8",
        "in-memory moments/9",
    ]
    data = LatentStoreDataset(path, flip=False, sample_posterior=False)
    assert len(data) == 10 and data.classes == ["0", "1", "2"] and data.flip_mode == "none"
    for i in range(10):
        latent, label = data[i]
        assert latent.dtype == torch.float32 and latent.shape == (4, 4, 4) and label == labels[i]
        torch.testing.assert_close(latent, moments[i, 0, 0] * 0.5, rtol=0, atol=0)
    assert verify_store(path)["num_images"] == 10


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_reader_samples_from_the_stored_posterior(tmp_path, dtype):
    moments = synthetic_moments(2, views=1)
    write_moments_store(str(tmp_path), moments, torch.tensor([0, 1]), 2, scale=0.5, storage_dtype=dtype)
    data = LatentStoreDataset(str(tmp_path), flip=False)
    torch.manual_seed(0)
    draws = torch.stack([torch.stack([x for x, _ in data.__getitems__([0, 1])]) for _ in range(4000)])
    tol = 0.01 if dtype == "fp16" else 0.02  # storage rounding + Monte Carlo error (sigma ~ 0.5/sqrt(4000))
    torch.testing.assert_close(draws.mean(0), moments[:, 0, 0] * 0.5, atol=0.04, rtol=tol)
    torch.testing.assert_close(draws.std(0), moments[:, 0, 1] * 0.5, atol=0.01, rtol=0.05)
    assert not torch.equal(draws[0], draws[1])  # fresh noise at every access


def test_stored_flips_are_drawn_about_half_the_time(store):
    path, moments, _ = store
    data = LatentStoreDataset(path, flip=True, sample_posterior=False)
    assert data.flip_mode == "stored"
    torch.manual_seed(0)
    batch = data.__getitems__(list(range(10)) * 100)
    flipped = [torch.equal(x, moments[i % 10, 1, 0] * 0.5) for i, (x, _) in enumerate(batch)]
    unflipped = [torch.equal(x, moments[i % 10, 0, 0] * 0.5) for i, (x, _) in enumerate(batch)]
    assert all(a != b for a, b in zip(flipped, unflipped))
    assert 420 < sum(flipped) < 580  # Binomial(1000, 0.5): > 5 sigma wide


def test_store_without_flips_mirrors_latents_half_the_time(tmp_path):
    moments = synthetic_moments(4, views=1)
    write_moments_store(str(tmp_path), moments, torch.zeros(4, dtype=torch.long), 1, storage_dtype="fp32")
    data = LatentStoreDataset(str(tmp_path), flip=True, sample_posterior=False)
    assert data.flip_mode == "latent"
    torch.manual_seed(0)
    batch = data.__getitems__([2] * 600)
    mirrored = sum(torch.equal(x, (moments[2, 0, 0] * 0.18215).flip(-1)) for x, _ in batch)
    assert 240 < mirrored < 360


def test_dataloader_batches_and_distributed_sampler_cover_every_item_once(store):
    path, moments, labels = store
    data = LatentStoreDataset(path, flip=False, sample_posterior=False)
    x, y = next(iter(DataLoader(data, batch_size=4, shuffle=True)))
    assert x.shape == (4, 4, 4, 4) and x.dtype == torch.float32 and y.dtype == torch.int64
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3)
        for x, y in DataLoader(data, batch_size=3, sampler=sampler):
            seen += [(round(float(v[0, 0, 0]), 6), int(label)) for v, label in zip(x, y)]
    expected = [(round(float(moments[i, 0, 0, 0, 0, 0]) * 0.5, 6), int(labels[i])) for i in range(10)]
    assert sorted(seen) == sorted(expected)


def test_worker_processes_draw_different_noise_and_pickles_stay_small(store):
    path = store[0]
    data = LatentStoreDataset(path, flip=False)
    assert len(pickle.dumps(data)) < 20_000  # memory maps are not pickled into spawned workers
    torch.manual_seed(0)
    loader = DataLoader(data, batch_size=1, sampler=[0, 0], num_workers=2)
    first, second = (x for x, _ in loader)
    assert not torch.equal(first, second)


def test_check_compatible_names_each_mismatch(store):
    data = LatentStoreDataset(store[0])
    data.check_compatible(in_channels=4, input_size=4, num_classes=3)
    with pytest.raises(UserError) as e:
        data.check_compatible(in_channels=8, input_size=8, num_classes=1000)
    message = str(e.value)
    assert "4 latent channels" in message and "in_channels=4" in message
    assert (
        "4x4 latents (32 px images)" in message and "--image-size 32" in message and "--image-size 64" in message
    )
    assert "3 classes" in message and "--num-classes 3" in message


def test_reader_refuses_truncated_and_incomplete_stores(store):
    path = store[0]
    shard = os.path.join(path, shard_file(1))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 10)
    with pytest.raises(UserError, match=r"shard-00001\.safetensors is missing or truncated.*extract_features"):
        LatentStoreDataset(path)
    manifest = json.loads(Path(path, MANIFEST).read_text())
    manifest["complete"] = False  # as an interrupted extraction leaves it (written with its checksum)
    write_manifest(str(path), manifest)
    with pytest.raises(UserError, match="incomplete"):
        LatentStoreDataset(path)


def test_verify_detects_a_flipped_bit(store):
    path = store[0]
    shard = os.path.join(path, shard_file(0))
    raw = bytearray(Path(shard).read_bytes())
    raw[-1] ^= 1
    Path(shard).write_bytes(bytes(raw))
    LatentStoreDataset(path)  # same size: only the checksum can tell
    with pytest.raises(UserError, match=r"shard-00000\.safetensors fails its sha256 check"):
        verify_store(path)


def test_a_different_store_is_not_overwritten(store):
    path = store[0]
    before = {name: Path(path, name).read_bytes() for name in os.listdir(path)}
    with pytest.raises(UserError, match=r"made differently.*latent_shape.*Nothing was overwritten"):
        write_moments_store(path, synthetic_moments(3, size=8), torch.zeros(3, dtype=torch.long), 3, scale=0.5)
    assert {name: Path(path, name).read_bytes() for name in os.listdir(path)} == before


def test_reads_follow_the_torch_seed_and_check_bounds(store):
    data = LatentStoreDataset(store[0], flip=True, sample_posterior=True)
    torch.manual_seed(5)
    batch = data.__getitems__([3, 7, 1])
    torch.manual_seed(5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batch, data.__getitems__([3, 7, 1])))
    with pytest.raises(IndexError):
        data[10]
    assert np.array_equal(data.labels, np.arange(10) % 3)


def test_an_empty_shard_keeps_the_global_index_contiguous(tmp_path):
    """A shard whose sources all failed to decode holds no images; the items around it must stay in order."""
    moments, labels = synthetic_moments(4, views=1), torch.arange(4)
    spec = StoreSpec(
        "x", "c", "w", 1.0, 32, [4, 4, 4], "fp32", "fp32", False, 2, {str(i): i for i in range(4)}, "s", 6
    )
    begin_store(str(tmp_path), spec)
    write_shard(str(tmp_path), 0, spec, moments[:2], labels[:2], ["0", "1"], [])
    write_shard(str(tmp_path), 1, spec, moments[:0], labels[:0], [], [["2", "corrupt"], ["3", "corrupt"]])
    write_shard(str(tmp_path), 2, spec, moments[2:], labels[2:], ["4", "5"], [])
    manifest = finalize_store(str(tmp_path), spec, [])
    assert manifest["num_images"] == 4 and manifest["num_skipped"] == 2
    data = LatentStoreDataset(str(tmp_path), flip=False, sample_posterior=False)
    assert [label for _, label in data.__getitems__([0, 1, 2, 3])] == [0, 1, 2, 3]
    torch.testing.assert_close(data[2][0], moments[2, 0, 0], rtol=0, atol=0)


# Every process (torchrun's ranks and their forked loader workers) logs each shard it hashes.
_COUNT_HASHES = """
import hashlib, os

_real = hashlib.file_digest


def _counting(f, digest, *args, **kwargs):
    name = os.path.basename(getattr(f, "name", ""))
    if name.startswith("shard-"):
        with open(os.environ["HASH_LOG"], "a") as log:
            log.write(f"{os.getpid()} {name}\\n")
    return _real(f, digest, *args, **kwargs)


hashlib.file_digest = _counting
"""


def test_two_ranks_with_two_workers_each_hash_each_shard_once(tmp_path):
    """Local rank 0 hashes the store before the loaders start and every loader process trusts it: one pass per
    node, not one per rank and worker (2 x 2 here, 8 x 4 on a GPU node)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    store = tmp_path / "store"
    write_moments_store(
        str(store), synthetic_moments(16), torch.arange(16) % 2, 2, storage_dtype="fp32", shard_size=4
    )
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_COUNT_HASHES)
    log = tmp_path / "hashes.log"
    env = {
        **os.environ,
        "HASH_LOG": str(log),
        "PYTHONPATH": f"{tmp_path / 'site'}:{os.environ.get('PYTHONPATH', '')}",
    }
    args = ["--feature-path", str(store), "--model", "DiT-S/2", "--depth", "1", "--hidden-size", "32",
            "--num-heads", "2", "--image-size", "32", "--num-classes", "2", "--global-batch-size", "8",
            "--max-steps", "1", "--precision", "fp32", "--num-workers", "2", "--log-every", "1", "--device", "cpu",
            "--peak-tflops", "0.05", "--no-progress", "--results-dir", str(tmp_path / "run")]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    done = subprocess.run([*torchrun, "train.py", *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    hashed = [line.split()[1] for line in log.read_text().splitlines()]
    assert sorted(hashed) == [shard_file(k) for k in range(4)]  # each shard once, all of them


def test_verify_once_hashes_up_front_and_trusts_only_unchanged_files(store, monkeypatch):
    import dit.data.reader as reader

    path = store[0]
    alone = SimpleNamespace(rank=0, local_rank=0, gather_objects=lambda obj: [obj])
    data = LatentStoreDataset(path)
    data.verify_once(alone)
    hashed = []
    monkeypatch.setattr(reader, "sha256_file", lambda f: hashed.append(os.path.basename(f)) or "changed")
    data[0], data[9]  # verified, unchanged: not hashed again
    assert hashed == []
    shard = Path(path, shard_file(1))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1))  # touched since: hashed again
    with pytest.raises(UserError, match=r"shard-00001\.safetensors fails its sha256 check"):
        data[5]
    assert hashed == [shard_file(1)]
    monkeypatch.undo()
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=r"shard-00001\.safetensors fails its sha256 check.*--verify"):
        LatentStoreDataset(path).verify_once(alone)  # before any loader starts
