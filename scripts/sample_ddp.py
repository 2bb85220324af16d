"""Write an FID sample set: PNGs and an ``.npz`` (arr_0, uint8 N x H x W x 3) for the ADM evaluator.

    torchrun --nproc_per_node=8 scripts/sample_ddp.py --ckpt DiT-XL-2-256x256.pt --model DiT-XL/2

Image i is seeded by (global seed, i), so the set is the same on any number of devices; rerunning the
same command after a kill finishes the set without duplicates or gaps.
"""

from __future__ import annotations

import argparse

from dit.cli import run_cli
from dit.engine.sampling import FidConfig, add_checkpoint_flags, distributed, write_fid_samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_flags(p, vae_default="ema")
    p.add_argument("--sample-dir", default="samples")
    p.add_argument("--per-proc-batch-size", type=int, default=32)
    p.add_argument("--num-fid-samples", type=int, default=50_000)
    p.add_argument("--cfg-scale", type=float, default=1.5, help="1.5 with 3 channels is the paper's FID setting")
    p.add_argument("--global-seed", type=int, default=0)
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
