"""Sample a grid of class-conditional images from a DiT checkpoint (ours or an official release).

python sample.py --ckpt results/DiT-XL-2-256/checkpoints/0400000.pt --cfg-scale 4 --out sample.png
python sample.py --model DiT-XL/2 --image-size 256 --ckpt DiT-XL-2-256x256.pt   # official weights
"""

from __future__ import annotations

from dit.io.cli import exit_process, run_cli
from dit.runtime import Runtime
from dit.sample.config import SAMPLE_FACE, parse_sample_config
from dit.sample.grid import run_sample

FACE = SAMPLE_FACE


def main(argv: list[str] | None = None) -> int:
    c = parse_sample_config(argv)
    with Runtime.of(c.runtime) as runtime:
        report = run_sample(c, runtime)
    print(f"wrote {report.path}: {len(report.labels)} images (labels {report.labels}, {report.weights} weights)")
    print(report.cost.summary())
    return 0


if __name__ == "__main__":
    exit_process(run_cli(main))
