"""The frozen VAE's encode in the run's precision: seconds and latent difference, float32 vs bf16 autocast.

  python studies/vae_precision.py                 # a tiny random VAE, then the SD VAE's shape at 256 px, batch 2
  python studies/vae_precision.py --tiny-only     # the tiny one alone (seconds)

Random weights (no download here): the difference is bf16's rounding at this shape. One JSON row per VAE."""

from __future__ import annotations

import argparse
import json
import time

import torch

from dit.cost.vae_facts import SD_VAE_CONFIG
from dit.data.vae import encode_moments
from dit.runtime.precision import Precision

# the SD VAE's layout, 4 channels wide (stabilityai/sd-vae-ft-ema's: 83.7M parameters, 273 GFLOP a 256 px encode)
TINY = {"block_out_channels": [4] * 4, "layers_per_block": 1, "norm_num_groups": 2}


def measure(sd_shape: bool, batch: int, size: int, repeats: int) -> dict:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(**{**SD_VAE_CONFIG, **({"sample_size": 256} if sd_shape else TINY)}).eval()
    images = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(1)) * 2 - 1
    row = {"vae": "sd-shaped random" if sd_shape else "tiny random", "batch": batch, "image_size": size}
    means = {}
    for name in ("fp32", "bf16"):
        precision = Precision(name)
        with precision.flags(), precision.frozen():
            encode_moments(vae, images)  # warm-up
            start = time.perf_counter()
            for _ in range(repeats):
                means[name] = encode_moments(vae, images)[0].float()
            row[f"{name}_seconds"] = (time.perf_counter() - start) / repeats
    row["latent_mean_rel_diff"] = ((means["bf16"] - means["fp32"]).norm() / means["fp32"].norm()).item()
    row["bf16_over_fp32_time"] = row["bf16_seconds"] / row["fp32_seconds"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-only", action="store_true")
    args = parser.parse_args()
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads()}))
    print(json.dumps(measure(False, 8, 32, repeats=20)))
    if not args.tiny_only:
        print(json.dumps(measure(True, 2, 256, repeats=2)))


if __name__ == "__main__":
    main()
