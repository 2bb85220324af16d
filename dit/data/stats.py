"""A store's per-channel statistics for ``--latent-norm channel``: the exact moments of the reader's draws,
E[z] = avg(mean), E[z^2] = avg(mean^2 + std^2), summed in float64 in a fixed order (the bytes decide them)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from safetensors import safe_open

CHUNK = 256  # images summed at a time: a bound on the float64 copy, fixed so the sums' order is too


def latent_stats(shard_paths: list[str], channels: int) -> dict | None:
    """``{"mean": [C], "std": [C], "values": n}`` from the shards' moments, summed in shard order."""
    if len(shard_paths) > 1:
        with ThreadPoolExecutor(max_workers=min(8, len(shard_paths), os.cpu_count() or 1)) as pool:
            sums = list(pool.map(_shard_sums, shard_paths, [channels] * len(shard_paths)))
    else:
        sums = [_shard_sums(path, channels) for path in shard_paths]
    total, squares, count = np.zeros(channels), np.zeros(channels), 0
    for shard_total, shard_squares, shard_count in sums:
        total, squares, count = total + shard_total, squares + shard_squares, count + shard_count
    if not count:
        return None
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean * mean, 0.0))
    return {"mean": mean.tolist(), "std": std.tolist(), "values": count}


def _shard_sums(path: str, channels: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One shard's per-channel sums of the posterior means and of mean^2 + std^2, and the values counted."""
    with safe_open(path, framework="pt") as f:
        moments = f.get_tensor("moments")
    total, squares = np.zeros(channels), np.zeros(channels)
    for start in range(0, len(moments), CHUNK):
        part = moments[start : start + CHUNK].float().numpy().astype(np.float64)  # each step exact
        n, views, _, c, h, w = part.shape
        mean, std = (part[:, :, k].reshape(n * views, c, h * w) for k in (0, 1))
        total += mean.sum(axis=2).sum(axis=0)
        squares += (np.einsum("ijk,ijk->ij", mean, mean) + np.einsum("ijk,ijk->ij", std, std)).sum(axis=0)
    return total, squares, moments[:, :, 0].numel() // channels


def stats_problem(stats, channels: int) -> str | None:
    """What is wrong with a manifest's ``latent_stats`` record, or None."""
    ok = isinstance(stats, dict) and isinstance(stats.get("values"), int)
    for key in ("mean", "std"):
        values = stats.get(key) if ok else None
        ok = ok and isinstance(values, list) and len(values) == channels
        ok = ok and all(isinstance(v, (int, float)) and np.isfinite(v) for v in values)
    ok = ok and all(s >= 0 for s in stats["std"])
    return None if ok else f"latent_stats is not {channels} finite means and {channels} stds >= 0 with a count"
