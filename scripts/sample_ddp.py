"""Write an FID sample set: PNGs and an ``.npz`` (arr_0, uint8 N x H x W x 3) for the ADM evaluator.

    torchrun --nproc_per_node=8 scripts/sample_ddp.py --ckpt DiT-XL-2-256x256.pt --model DiT-XL/2

Image i is seeded by (global seed, i), so the set is the same on any number of devices; rerunning the
same command after a kill finishes the set without duplicates or gaps.
"""

from __future__ import annotations

import argparse

from dit.cli import run_cli
from dit.engine.sampling import PRECISIONS, SAMPLERS, FidConfig, distributed, write_fid_samples
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
        help="ema, mse, a hub id, a folder, or none (default: ema as official, or the run's own non-SD VAE)",
    )
    p.add_argument("--sample-dir", default="samples")
    p.add_argument("--per-proc-batch-size", type=int, default=32)
    p.add_argument("--num-fid-samples", type=int, default=50_000)
    p.add_argument("--cfg-scale", type=float, default=1.5, help="1.5 with 3 channels is the paper's FID setting")
    p.add_argument("--cfg-channels", default="3", choices=["3", "all"])
    p.add_argument("--num-sampling-steps", type=int, default=250)
    p.add_argument("--sampler", default="ddpm", choices=SAMPLERS)
    p.add_argument("--global-seed", type=int, default=0)
    p.add_argument("--precision", default="tf32", choices=PRECISIONS)
    p.add_argument("--no-ema", dest="ema", action="store_false", help="sample with the raw weights, not the EMA")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument(
        "--peak-tflops", type=float, help="device peak for MFU (default: datasheet table, else measured)"
    )
    cfg = FidConfig(**vars(p.parse_args(argv)))
    with distributed(cfg.device) as (rank, world, device):
        report = write_fid_samples(cfg, rank, world, device)
    if report.npz is not None:
        print(f"wrote {report.npz} ({cfg.num_fid_samples} samples; PNGs in {report.folder})")
        if report.cost is not None:
            print(f"rank 0 {report.cost.summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
