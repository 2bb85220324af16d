"""Train a DiT: `torchrun --nproc_per_node=N train.py --model DiT-XL/2 --feature-path latents/` (or plain python)."""

import sys

from dit.cli import run_cli
from dit.config import parse_config
from dit.train import TrainConfig, train


def main(argv=None):
    train(parse_config(TrainConfig, argv, description=__doc__))


if __name__ == "__main__":
    sys.exit(run_cli(main))
