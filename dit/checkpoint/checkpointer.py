"""``Checkpointer``: the one place that picks how a run saves its ``TrainState``: one file from rank 0, or every
rank's shards of a step's folder (FSDP, optionally in the background); either restores into either run."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

import dit.checkpoint.sharded as sharded
from dit.checkpoint.format import SHARDED, checkpoint_path, retire, save_training_checkpoint, stamped
from dit.checkpoint.posthoc import snapshot_folder
from dit.checkpoint.section import CheckpointSection
from dit.io.atomic import CannotWrite


class Checkpointer:
    def __init__(self, section: CheckpointSection, runtime):
        self.section, self.folder, self.runtime = section, section.folder, runtime
        self.pending = None  # (temp folder, final folder, step, record, future) of a sharded save not sealed yet
        self.saved: list[tuple[int, str]] = []  # (step, path) of the saves not reported yet
        self._group = self._asking = None

    def save(self, state) -> None:
        """``state`` as its step's checkpoint (every rank calls it); a refused write leaves nothing partial."""
        self._write(state, state.state_dict(self.runtime), self.folder, self.section.async_checkpoint)

    def snapshot_due(self, state, last: bool) -> bool:
        """Whether to snapshot the EMA profiles: every ``ema_snapshot_every`` steps and at the ``last``."""
        return bool(state.ema.profiles) and (last or state.step % self.section.ema_snapshot_every == 0)

    def snapshot(self, state) -> None:
        """``state``'s post-hoc EMA profiles in ``checkpoints/ema/``, written as a checkpoint is and all kept."""
        self._write(state, state.snapshot_dict(self.runtime), snapshot_folder(self.folder), False)

    def _write(self, state, payload, folder: Path, background: bool) -> None:
        if not state.sharded:
            refused = None
            if payload is not None:
                try:
                    path = save_training_checkpoint(folder, state.step, payload, *self._retention(folder))
                    self.saved += [(state.step, str(path))] if folder == self.folder else []
                except CannotWrite as e:
                    refused = e
            self.runtime.raise_together(refused)
            return
        self.wait()
        final = checkpoint_path(folder, state.step, sharded=True)
        temp = sharded.temp_folder(final)
        tensors, record = sharded.split(payload)
        with self._written(temp, final):
            future = sharded.write(temp, tensors, self._async_group(), background=background)
        self.pending = (temp, final, state.step, stamped(state.step, record), future)
        if not background:
            self.wait()

    def _retention(self, folder: Path) -> tuple[int, int]:
        return (self.section.keep_last, self.section.keep_every) if folder == self.folder else (0, 0)

    def wait(self) -> None:
        """Seal the sharded save in progress (every rank calls it): hashes, record, manifest, rename, retention."""
        if self.pending is None:
            return
        temp, final, step, record, future = self.pending
        self.pending = None
        if future is not None:
            with self._written(temp, final):
                future.result()
        digests = self.runtime.gather_objects(sharded.own_digests(temp, self.runtime.rank))
        refused = None
        if self.runtime.is_main:
            try:
                sharded.seal(temp, final, step, record, {k: v for d in digests for k, v in d.items()})
                retire(final.parent, step, *self._retention(final.parent))
                self.saved += [(step, str(final))] if final.parent == self.folder else []
            except (CannotWrite, OSError) as e:
                refused = e if isinstance(e, CannotWrite) else CannotWrite(final, e)
                shutil.rmtree(temp, ignore_errors=True)
        self.runtime.raise_together(refused)

    def check(self, everyone: bool) -> None:
        """Stop on a failed background save as soon as it shows (several processes: when ``everyone`` asks)."""
        future = self.pending[4] if self.pending is not None else None
        if future is None:
            return
        failed = future.done() and future.exception() is not None
        if self.runtime.world > 1:
            if not everyone:
                return
            flag = torch.tensor([int(failed)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._asking)
            failed = bool(flag.item())
        if failed:
            self.wait()  # every rank: the future's error, as the line

    @contextmanager
    def _written(self, temp: Path, final: Path):
        """DCP's writes: a refused one (each rank gets every rank's error) removes the temp folder."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            yield
        except CheckpointException as e:
            errors = [exc for exc, _ in e.failures.values() if isinstance(exc, OSError)]
            if not errors:
                raise
            if self.runtime.is_main:
                shutil.rmtree(temp, ignore_errors=True)
            self.runtime.raise_together(CannotWrite(final, errors[0]) if self.runtime.is_main else None)

    def take_saved(self) -> list[tuple[int, str]]:
        saved, self.saved = self.saved, []
        return saved

    def _async_group(self):
        """Gloo groups of their own for the background writer and for asking how it went."""
        if not self.section.async_checkpoint:
            return None
        if self._group is None:
            self._group, self._asking = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        return self._group

    def restore(self, state, ckpt: dict, source: str) -> list[str]:
        """Continue ``state`` from ``ckpt`` (a sharded folder resharded, or read whole); lines for the log."""
        folder = ckpt.get(SHARDED)
        if folder is None:
            return state.load_state_dict(ckpt, self.runtime, source)
        if not state.sharded:
            return state.load_state_dict(sharded.read(Path(folder)), self.runtime, source)
        tensors, _ = sharded.split(state.state_dict(self.runtime))  # this run's shards, filled in place
        sharded.read_into(Path(folder), tensors)
        return state.load_state_dict(sharded.merge(ckpt, tensors), self.runtime, source)
