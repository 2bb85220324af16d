"""Latent-store reader throughput (samples/s per process) from the page cache.

python scripts/bench_reader.py                      # a synthetic 4x32x32 store (256 px ImageNet-like)
python scripts/bench_reader.py --store STORE        # an existing store
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

from dit.cli import run_cli
from dit.data.latents import LatentStoreDataset, write_moments_store


class PerItem(Dataset):
    """The store without its batched ``__getitems__``: DataLoader then calls ``__getitem__`` once per sample."""

    def __init__(self, store: LatentStoreDataset):
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: int):
        return self.store[index]


def samples_per_second(loader: DataLoader, seconds: float) -> float:
    """Iterate (restarting epochs) for about ``seconds``; samples delivered per wall-clock second."""
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for x, _ in loader:
            count += len(x)
            if time.perf_counter() - start >= seconds:
                break
    return count / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", help="an existing store (default: build a synthetic one in a temp folder)")
    p.add_argument("--images", type=int, default=10_000, help="synthetic store size")
    p.add_argument("--latent-size", type=int, default=32)
    p.add_argument("--storage-dtype", default="fp16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seconds", type=float, default=3.0, help="time per measurement")
    p.add_argument("--repeats", type=int, default=5, help="measurements per reader path (best and median shown)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 = one data process's share)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.store
        if path is None:
            path = tmp
            g = torch.Generator().manual_seed(0)
            size, chunks = args.latent_size, range(0, args.images, 1000)
            moments = torch.cat(
                [torch.randn(min(1000, args.images - i), 2, 2, 4, size, size, generator=g).half() for i in chunks]
            )
            moments[:, :, 1].abs_()
            labels = torch.randint(0, 1000, (args.images,), generator=g)
            write_moments_store(path, moments, labels, 1000, storage_dtype=args.storage_dtype)
            del moments
        store = LatentStoreDataset(path)
        print(
            f"store {path}: {len(store)} items of {store.latent_shape}, {store.manifest['storage_dtype']}, "
            f"flip mode {store.flip_mode}, batch {args.batch_size}, {args.threads} thread(s)"
        )
        batched = DataLoader(store, batch_size=args.batch_size, shuffle=True, num_workers=0)
        per_item = DataLoader(PerItem(store), batch_size=args.batch_size, shuffle=True, num_workers=0)
        samples_per_second(batched, 1.0)  # warm the page cache and the allocator
        for name, loader in (("batched (__getitems__)", batched), ("per item (__getitem__)", per_item)):
            rates = sorted(samples_per_second(loader, args.seconds) for _ in range(args.repeats))
            print(
                f"{name}: best {rates[-1]:8.0f}  median {rates[len(rates) // 2]:8.0f} samples/s "
                f"over {args.repeats} x {args.seconds:g} s (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
