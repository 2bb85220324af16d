"""Pre-extract VAE latents into a sharded, checksummed, resumable latent store (docs/latent_store.md).

python extract_features.py --data-path IMAGES --features-path STORE --image-size 256 --vae ema
torchrun --nproc_per_node=8 extract_features.py --data-path IMAGES --features-path STORE ...
python extract_features.py --features-path STORE --verify
"""

from __future__ import annotations

import argparse
import sys

from dit.cli import run_cli
from dit.data.latents import ExtractConfig, config_from_flags, extract_features, verify_store
from dit.errors import UserError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = ExtractConfig(data_path="", features_path="")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", help="ImageNet-style folder: one sub-folder per class")
    p.add_argument("--features-path", required=True, help="the store folder (created, resumed or verified)")
    p.add_argument("--image-size", type=int, default=d.image_size, help="ADM centre-crop size in pixels")
    p.add_argument("--vae", default=d.vae, help="ema | mse | a Hugging Face hub id | a local folder")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="images per encoder call (per process)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default=d.precision, help="encoder arithmetic")
    p.add_argument("--storage-dtype", choices=["fp32", "bf16", "fp16"], default=d.storage_dtype)
    p.add_argument("--no-flip", action="store_true", help="do not store the moments of mirrored images")
    p.add_argument("--shard-size", type=int, default=d.shard_size, help="source images per shard")
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="image-decoding processes per rank")
    p.add_argument("--strict", action="store_true", help="fail on corrupt/non-image files and empty classes")
    p.add_argument("--verify", action="store_true", help="only check every shard's sha256 and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verify:
        manifest = verify_store(args.features_path)
        print(
            f"{args.features_path}: {len(manifest['shards'])} shards, {manifest['num_images']} images, sha256 OK"
        )
        return 0
    if not args.data_path:
        raise UserError("--data-path is required to extract (only --verify works without it).")
    extract_features(config_from_flags(**vars(args)))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
