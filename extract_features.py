"""Pre-extract VAE latents into a sharded, checksummed, resumable latent store (docs/latent_store.md).

python extract_features.py --data-path IMAGES --feature-path STORE --image-size 256 --vae ema
torchrun --nproc_per_node=8 extract_features.py --data-path IMAGES --feature-path STORE ...
python extract_features.py --feature-path STORE --verify
python extract_features.py --feature-path STORE --stats
"""

from __future__ import annotations

from dit.data.store import verify_store
from dit.extract import EXTRACT_FACE, extract_features
from dit.extract.stats import write_latent_stats
from dit.io.cli import exit_process, run_cli

FACE = EXTRACT_FACE


def main(argv: list[str] | None = None) -> int:
    sections = FACE.parse(argv).sections
    cfg = sections["extract"]
    if cfg.stats:
        manifest = write_latent_stats(cfg.feature_path)
        stats = manifest.get("latent_stats")
        means = ", ".join(f"{m:.4g}" for m in stats["mean"]) if stats else "none: the store holds no images"
        stds = f"; stds {', '.join(f'{s:.4g}' for s in stats['std'])}" if stats else ""
        print(f"{cfg.feature_path}: sha256 OK; per-channel latent means {means}{stds}; written to its manifest")
        return 0
    if cfg.verify:
        manifest = verify_store(cfg.feature_path)
        print(f"{cfg.feature_path}: {len(manifest['shards'])} shards, {manifest['num_images']} images, sha256 OK")
        return 0
    extract_features(cfg, sections["repa_encoder"])
    return 0


if __name__ == "__main__":
    exit_process(run_cli(main))
