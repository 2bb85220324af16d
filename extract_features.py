"""Pre-extract VAE latents into a sharded, checksummed, resumable latent store (docs/latent_store.md).

python extract_features.py --data-path IMAGES --features-path STORE --image-size 256 --vae ema
torchrun --nproc_per_node=8 extract_features.py --data-path IMAGES --features-path STORE ...
python extract_features.py --features-path STORE --verify
"""

from __future__ import annotations

import sys

from dit.cli import run_cli
from dit.config import parse_config
from dit.data.store import verify_store
from dit.extract import ExtractConfig, extract_features


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ExtractConfig, argv, description=__doc__)
    if cfg.verify:
        manifest = verify_store(cfg.features_path)
        print(f"{cfg.features_path}: {len(manifest['shards'])} shards, {manifest['num_images']} images, sha256 OK")
        return 0
    extract_features(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
