"""Write an FID sample set: PNGs and an ``.npz`` (arr_0, uint8 N x H x W x 3) for the ADM evaluator.

    torchrun --nproc_per_node=8 scripts/sample_ddp.py --ckpt DiT-XL-2-256x256.pt --model DiT-XL/2

The same set on any number of devices; rerunning after a kill finishes it without duplicates or gaps."""

from __future__ import annotations

from dit.io.cli import exit_process, run_cli
from dit.runtime import Runtime
from dit.sample.config import FID_FACE, parse_fid_config
from dit.sample.fid_set import write_fid_samples

FACE = FID_FACE


def main(argv: list[str] | None = None) -> int:
    cfg = parse_fid_config(argv)
    with Runtime.of(cfg.runtime) as runtime:
        report = write_fid_samples(cfg, runtime)
    if report.npz is not None:
        print(
            f"wrote {report.npz} ({cfg.fid.num_fid_samples} samples, {report.labels} labels; PNGs in {report.folder})"
        )
        if report.cost is not None:
            print(f"rank 0 {report.cost.summary()}")
    return 0


if __name__ == "__main__":
    exit_process(run_cli(main))
