"""Train a DiT: `torchrun --nproc_per_node=N train.py --model DiT-XL/2 --feature-path latents/` (or plain python).

Exit status: 0 finished, 128 + the signal's number when stopped by one (143 SIGTERM, 130 SIGINT, 129 SIGHUP,
138 SIGUSR1; saved: rerun with --resume auto), 2 a user error (one line on stderr), 1 a bug.
"""

from dit.io.cli import exit_process, run_cli
from dit.runtime.stop import EXIT_CODES
from dit.train import TRAIN_FACE, resolve, train

FACE = TRAIN_FACE


def main(argv=None) -> int:
    result = train(resolve(argv))
    return EXIT_CODES.get(result["signal"], 0)


if __name__ == "__main__":
    exit_process(run_cli(main))
