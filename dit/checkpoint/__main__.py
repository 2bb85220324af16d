"""One file from a sharded checkpoint folder (an FSDP run's), on one process with no process group.

python -m dit.checkpoint export RUN/checkpoints/0000100 OUT.pt

OUT.pt is a checkpoint like a one-process run's (its ``.sha256`` beside it): sample.py reads it, and
train.py resumes or fine-tunes from it. sample.py and --init-from also read the folder itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dit.checkpoint.format import atomic_torch_save, load_checkpoint
from dit.io.cli import run_cli
from dit.io.config import Parser
from dit.io.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m dit.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a sharded checkpoint folder as one .pt file")
    export.add_argument("folder", type=Path, help="a sharded checkpoint folder, RUN/checkpoints/NNNNNNN")
    export.add_argument("out", type=Path, help="the .pt file to write")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        raise UserError(
            f"{args.folder} is not a folder: pass a sharded checkpoint folder (RUN/checkpoints/NNNNNNN)."
        )
    path = atomic_torch_save(load_checkpoint(args.folder), args.out)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
