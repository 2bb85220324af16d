"""Checkpoint tools, on one process with no process group.

python -m dit.checkpoint export RUN/checkpoints/0000100 OUT.pt
python -m dit.checkpoint ema RUN --sigma-rel 0.1

export: one file from a sharded checkpoint folder (an FSDP run's), a checkpoint like a one-process run's (its
``.sha256`` beside it): sample.py reads it, and train.py resumes or fine-tunes from it (sample.py and
--init-from also read the folder itself). ema: the post-hoc EMA of width sigma_rel reconstructed from a run's
snapshots (train.py --ema-profiles), as a checkpoint whose EMA weights sample.py and python -m dit.eval read."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from dit.checkpoint.format import atomic_torch_save, load_checkpoint
from dit.checkpoint.posthoc import MAX_SIGMA_REL, reconstruct
from dit.io.cli import run_cli
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.io.face import Face


@dataclass(frozen=True)
class ExportConfig(Section):
    """A sharded checkpoint folder as one .pt file."""

    folder: str = option(help="a sharded checkpoint folder, RUN/checkpoints/NNNNNNN", positional=True)
    out: str = option(help="the .pt file to write (outside the folder it reads)", positional=True)


@dataclass(frozen=True)
class EmaConfig(Section):
    """The post-hoc EMA of any width, reconstructed from a run's snapshots (docs/ema.md)."""

    run_folder: str = option(
        help="a run folder trained with --ema-profiles (its checkpoints/ema/ snapshots)", positional=True
    )
    sigma_rel: float = option(0.1, "the EMA's width relative to the training length (EDM2: 0.05 to 0.15)", gt=0)
    step: int | None = option(None, "the snapshot step to reconstruct at (default: the newest)", ge=1)
    out: str | None = option(None, "the .pt file to write (default: RUN/ema-SIGMA_REL-STEP.pt)")

    def check(self) -> None:
        if self.sigma_rel > MAX_SIGMA_REL:
            raise FieldError(
                f"{{sigma_rel}} {self.sigma_rel:g} is wider than any power-function EMA (at most "
                f"{MAX_SIGMA_REL:.4f}, the plain average of the whole run): pass a smaller one."
            )


# The Face checks OUT against FOLDER before anything is read: written inside it, it broke the checkpoint.
FACE = Face(
    "python -m dit.checkpoint",
    __doc__,
    commands={
        name: Face(
            f"python -m dit.checkpoint {name}",
            cls.__doc__,
            sections={name: cls},
            inputs=inputs,
            outputs={"out": "file"},
        )
        for name, cls, inputs in (
            ("export", ExportConfig, {"folder": "folder"}),
            ("ema", EmaConfig, {"run_folder": "file"}),
        )
    },
)


def main(argv: list[str] | None = None) -> int:
    parsed = FACE.parse(argv)
    c = parsed.sections[parsed.command]
    if parsed.command == "export":
        if not Path(c.folder).is_dir():
            raise UserError(
                f"{c.folder} is not a folder: pass a sharded checkpoint folder (RUN/checkpoints/NNNNNNN)."
            )
        path = atomic_torch_save(load_checkpoint(Path(c.folder)), c.out)
        print(f"wrote {path}", flush=True)
        return 0
    if not Path(c.run_folder).is_dir():
        raise UserError(f"{c.run_folder} is not a folder: pass a run folder (train.py's --results-dir).")
    ckpt = reconstruct(c.run_folder, c.sigma_rel, c.step)
    made = ckpt["posthoc_ema"]
    path = atomic_torch_save(ckpt, c.out or Path(c.run_folder) / f"ema-{c.sigma_rel:g}-{made['step']:07d}.pt")
    print(
        f"wrote {path}: the EMA of sigma_rel {c.sigma_rel:g} at step {made['step']} from "
        f"{len(made['coefficients'])} snapshot profiles (profile residual {made['residual']:.2%})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
