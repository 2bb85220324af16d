"""``CheckpointSection``: where a run keeps its checkpoints, how often and how many, and what it starts from."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError

_TOLD: set[str] = set()  # fallbacks already reported


@dataclass(frozen=True)
class CheckpointSection(Section):
    """Where a run keeps its state and what it starts from: a fresh start, a resume, or other weights."""

    results_dir: str = option("results/run", "this run's folder: checkpoints, config.yaml, metrics, TensorBoard")
    resume: str | None = option(
        None,
        "auto (the latest of the branch that ran last in --results-dir) or a checkpoint path (another: a new branch)",
    )
    init_from: str | None = option(
        None,
        "fine-tune: start a fresh run from these weights (an official release, an official train.py file, or ours)",
    )
    init_from_weights: str = option("ema", "which weights of --init-from", choices=("ema", "model"))
    allow_changes: tuple[str, ...] | None = option(
        None, "on --resume, recipe fields that may differ from the checkpoint's (lr, weight_decay, ...)"
    )
    ckpt_every: int = option(50_000, "steps per checkpoint", ge=1)
    keep_last: int = option(5, "checkpoints to keep, files and sharded folders alike (0: all)", ge=0)
    keep_every: int = option(
        0,
        "also keep every checkpoint whose step is a multiple of N for good: --keep-last never deletes it (0: none)",
        ge=0,
    )
    ema_snapshot_every: int = option(
        5_000, "with --ema-profiles: steps per snapshot of the profiles (checkpoints/ema/; kept for good)", ge=1
    )
    async_checkpoint: bool = option(
        False, "FSDP: write each sharded checkpoint in the background; the next save or the run's end waits for it"
    )

    # What a resumed run does not take from its record: how this start was asked for.
    START_ONLY = ("resume", "init_from", "init_from_weights", "allow_changes")

    def check(self) -> None:
        if self.init_from and self.resume:
            raise FieldError(
                "{init_from} starts a new run from other weights and {resume} continues one: pass one of them "
                "(a fine-tune started with {init_from} is continued with {resume} auto alone)."
            )
        if Path(self.results_dir).exists() and not Path(self.results_dir).is_dir():
            raise FieldError(
                f"{{results_dir}} {self.results_dir} is a file: pass a folder (it is created if missing)."
            )

    @property
    def folder(self) -> Path:
        return Path(self.results_dir) / "checkpoints"

    def resume_path(self) -> Path | None:
        """The checkpoint a resume continues (None: a fresh run, also for auto in an empty folder)."""
        if not self.resume:
            return None
        if self.resume != "auto":
            return Path(self.resume)
        from dit.checkpoint.lineage import follow

        path, bad = follow(self.folder)
        if bad:
            names = ", ".join(p.name for p in bad)
            if path is None:
                raise UserError(
                    f"no checkpoint in {self.folder} matches its checksum ({names} changed since they were "
                    "saved): restore one from a copy, or start a new run in another --results-dir."
                )
            if names not in _TOLD:
                _TOLD.add(names)
                print(f"--resume auto: {names} fail their checksum (changed since saved); resuming from "
                      f"{path.name}", file=sys.stderr, flush=True)  # fmt: skip
        return path
