"""Sample a grid of class-conditional images from a DiT checkpoint (ours or an official release).

python sample.py --ckpt results/000-DiT-XL-2/checkpoints/0400000.pt --cfg-scale 4 --out sample.png
python sample.py --model DiT-XL/2 --image-size 256 --ckpt DiT-XL-2-256x256.pt   # official weights
"""

from __future__ import annotations

import argparse

from dit.cli import run_cli
from dit.engine.sampling import PRECISIONS, SAMPLERS, SampleConfig, run_sample
from dit.models import MODEL_NAMES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ckpt", required=True, help="our training checkpoint, an official train.py file, or a bare state dict"
    )
    p.add_argument("--model", choices=MODEL_NAMES, help="for files without a config (default DiT-XL/2)")
    p.add_argument("--image-size", type=int, help="pixels per side, for files without a config (default 256)")
    p.add_argument("--num-classes", type=int, help="for files without a config (default 1000)")
    p.add_argument(
        "--vae",
        help="ema, mse, a hub id, a folder, or none (default: mse as official, or the run's own non-SD VAE)",
    )
    p.add_argument("--cfg-scale", type=float, default=4.0, help="classifier-free guidance scale; 1 disables it")
    p.add_argument(
        "--cfg-channels", default="3", choices=["3", "all"], help="noise channels to guide (official: 3)"
    )
    p.add_argument("--num-sampling-steps", type=int, default=250)
    p.add_argument("--sampler", default="ddpm", choices=SAMPLERS)
    p.add_argument("--class-labels", type=int, nargs="+", help="one image per label (default: the official eight)")
    p.add_argument("--seed", type=int, default=0, help="image i uses the noise of (seed, i)")
    p.add_argument("--precision", default="tf32", choices=PRECISIONS)
    p.add_argument("--no-ema", dest="ema", action="store_false", help="sample with the raw weights, not the EMA")
    p.add_argument("--out", default="sample.png", help="PNG grid to write")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument(
        "--peak-tflops", type=float, help="device peak for MFU (default: datasheet table, else measured)"
    )
    args = p.parse_args(argv)
    report = run_sample(SampleConfig(**vars(args)))
    print(f"wrote {report.path}: {len(report.labels)} images (labels {report.labels}, {report.weights} weights)")
    print(report.cost.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
