"""``extract_features.py --stats``: the per-channel latent statistics written into an older store's manifest."""

from __future__ import annotations

import os

from dit.data.stats import latent_stats
from dit.data.store import read_manifest, verify_store, write_manifest
from dit.io.atomic import FolderLock


def write_latent_stats(folder: str) -> dict:
    """Verify every shard, then rewrite the manifest with the statistics, atomically and under the lock."""
    read_manifest(folder)  # not a store: refused before the lock creates anything
    with FolderLock(folder, "extraction", "wait for it to finish, then rerun --stats"):
        manifest = verify_store(folder)
        paths = [os.path.join(folder, shard["file"]) for shard in manifest["shards"]]
        stats = latent_stats(paths, manifest["latent_shape"][0])
        manifest = {k: v for k, v in manifest.items() if k not in ("manifest_sha256", "latent_stats")}
        if stats is not None:
            manifest["latent_stats"] = stats
        write_manifest(folder, manifest)
    return manifest
