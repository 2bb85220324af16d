"""One file from a sharded checkpoint folder (an FSDP run's), on one process with no process group.

python -m dit.checkpoint export RUN/checkpoints/0000100 OUT.pt

OUT.pt is a checkpoint like a one-process run's (its ``.sha256`` beside it): sample.py reads it, and
train.py resumes or fine-tunes from it. sample.py and --init-from also read the folder itself.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from dit.checkpoint.format import atomic_torch_save, load_checkpoint
from dit.io.cli import run_cli
from dit.io.config import Face, Section, option
from dit.io.errors import UserError


@dataclass(frozen=True)
class ExportConfig(Section):
    """A sharded checkpoint folder as one .pt file."""

    folder: str = option(help="a sharded checkpoint folder, RUN/checkpoints/NNNNNNN", positional=True)
    out: str = option(help="the .pt file to write (outside the folder it reads)", positional=True)


# The Face checks OUT against FOLDER before anything is read: written inside it, it broke the checkpoint.
FACE = Face(
    "python -m dit.checkpoint",
    __doc__,
    commands={
        "export": Face(
            "python -m dit.checkpoint export",
            ExportConfig.__doc__,
            sections={"export": ExportConfig},
            inputs={"folder": "folder"},
            outputs={"out": "file"},
        )
    },
)


def main(argv: list[str] | None = None) -> int:
    c = FACE.parse(argv).sections["export"]
    if not Path(c.folder).is_dir():
        raise UserError(f"{c.folder} is not a folder: pass a sharded checkpoint folder (RUN/checkpoints/NNNNNNN).")
    path = atomic_torch_save(load_checkpoint(Path(c.folder)), c.out)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
