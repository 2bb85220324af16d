"""Weights & Biases (``--sinks wandb``): numbers as ``KIND/key``, sample grids, the configuration
(``WANDB_MODE=offline`` keeps the run local); the ledger finds ``SINK`` and ``WandBOptions`` by the file's name."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from dit.io.atomic import atomic_write_bytes
from dit.io.config import Section, option
from dit.io.errors import UserError, require
from dit.train.sinks import Sink, numbers


@dataclass(frozen=True)
class WandBOptions(Section):
    """Flags and record entries of the ledger's section (``LedgerSection`` is made of them)."""

    wandb_project: str = option("dit-ledger", "the W&B project of --sinks wandb")
    wandb_entity: str | None = option(None, "the W&B team or user of --sinks wandb (none: W&B's default)")


class WandB(Sink):
    """One W&B run per results folder; a resume continues it with W&B's rewind (docs/reliability.md, row 52)."""

    options = WandBOptions

    def __init__(self, section, out: Path, record: dict, start: int):
        self.wandb = require("wandb", "wandb", "--sinks wandb")
        self.path, kept = out / "wandb", out / "wandb" / "run-id"
        if start and kept.is_file():
            begin = {"resume_from": f"{kept.read_text().strip()}?_step={start}"}
        else:  # a fresh run, or the first segment with W&B: a run of its own
            begin = {"id": secrets.token_hex(6)}
            atomic_write_bytes(kept, begin["id"].encode())
        try:
            self.run = self.wandb.init(project=section.wandb_project, entity=section.wandb_entity, name=out.name,
                                       dir=out, config=record, **begin)  # fmt: skip
        except self.wandb.errors.Error as e:
            raise UserError(
                f"--sinks wandb: W&B did not start: {e}. Log in (wandb login), or set WANDB_MODE=offline to keep "
                f"the run in {self.path} and upload it later with wandb sync."
            ) from None

    def scalars(self, record: dict, step: int) -> None:
        self.run.log(numbers(record), step=step)

    def image(self, tag: str, image_chw, step: int) -> None:
        self.run.log({tag: self.wandb.Image(image_chw)}, step=step)

    def close(self) -> None:
        self.run.finish()


SINK = WandB
