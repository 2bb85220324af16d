"""Sample a grid of class-conditional images from a DiT checkpoint (ours or an official release).

python sample.py --ckpt results/000-DiT-XL-2/checkpoints/0400000.pt --cfg-scale 4 --out sample.png
python sample.py --model DiT-XL/2 --image-size 256 --ckpt DiT-XL-2-256x256.pt   # official weights
"""

from __future__ import annotations

import argparse

from dit.cli import run_cli
from dit.engine.sampling import SampleConfig, add_checkpoint_flags, run_sample


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(p, vae_default="mse")
    p.add_argument("--cfg-scale", type=float, default=4.0, help="classifier-free guidance scale; 1 disables it")
    p.add_argument("--class-labels", type=int, nargs="+", help="one image per label (default: the official eight)")
    p.add_argument("--seed", type=int, default=0, help="image i uses the noise of (seed, i)")
    p.add_argument("--out", default="sample.png", help="PNG grid to write")
    args = p.parse_args(argv)
    report = run_sample(SampleConfig(**vars(args)))
    print(f"wrote {report.path}: {len(report.labels)} images (labels {report.labels}, {report.weights} weights)")
    print(report.cost.summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
