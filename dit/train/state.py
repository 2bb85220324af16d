"""``TrainState``: everything a run needs to continue exactly, saved and loaded only through ``dit.checkpoint``,
with the optimizer keyed by parameter name, so that a checkpoint resumes with or without FSDP."""

from __future__ import annotations

import torch
from torch import nn

from dit.checkpoint.posthoc import PROFILES
from dit.io.errors import UserError
from dit.model.dit import DiT
from dit.runtime import Runtime
from dit.train.ema import EMA
from dit.train.parallel import load_model_state, load_optimizer_state, model_state, optimizer_state


class TrainState:
    def __init__(
        self,
        model: DiT,
        ema: EMA,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        sharded: bool,
        dataset_len: int,
        steps_per_epoch: int,
        trained: nn.Module | None = None,
        record: dict | None = None,
        latent_norm: dict | None = None,
    ):
        """``trained``: what the optimizer steps; ``latent_norm``: ``ChannelNorm.record()``; ``lineage``: later."""
        self.model, self.ema, self.optimizer, self.scaler = model, ema, optimizer, scaler
        self.sharded, self.dataset_len, self.steps_per_epoch = sharded, dataset_len, steps_per_epoch
        self.trained = model if trained is None else trained
        self.projector = getattr(self.trained, "projector", None)
        self.record, self.lineage, self.latent_norm = record, None, latent_norm
        self.step = 0
        self.data_changes: list[dict] = []  # (step, new size, old size) of each resume on a smaller data set

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def state_dict(self, runtime: Runtime) -> dict | None:
        """The whole payload on rank 0 (None elsewhere), or under FSDP every rank's shards; collective."""
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        rng = runtime.gather_objects({"cpu": torch.get_rng_state(), "cuda": cuda})
        if not (self.sharded or runtime.is_main):
            return None
        state = {
            "step": self.step,
            "model": model_state(self.model, self.sharded),
            "ema": model_state(self.ema.model, self.sharded),
            "ema_updates": self.ema.num_updates,
            "optimizer": optimizer_state(self.trained, self.optimizer, self.sharded),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": {str(r): s for r, s in enumerate(rng)},
            "data_position": dict(
                step=self.step, epoch=self.epoch, dataset_len=self.dataset_len, changes=self.data_changes
            ),
            "config": self.record,
            "model_config": self.model.config.to_dict(),
            "lineage": self.lineage,
        }
        if self.latent_norm is not None:
            state["latent_norm"] = self.latent_norm
        if self.projector is not None:
            state["repa_projector"] = model_state(self.projector, self.sharded)
        if self.ema.profiles:
            state[PROFILES] = self._profiles()
        return state

    def _profiles(self) -> dict:
        return {key: model_state(p.model, self.sharded) for key, p in self.ema.profiles.items()}

    def snapshot_dict(self, runtime: Runtime) -> dict | None:
        """A post-hoc EMA snapshot's payload: the profiles and what the run is, on rank 0 (or all shards)."""
        if not (self.sharded or runtime.is_main):
            return None
        run = {"config": self.record, "model_config": self.model.config.to_dict(), "lineage": self.lineage}
        norm = {"latent_norm": self.latent_norm} if self.latent_norm is not None else {}
        return {PROFILES: self._profiles(), **run, **norm}

    def load_state_dict(self, state: dict, runtime: Runtime, source: str = "checkpoint") -> list[str]:
        """Continue from ``state``; lines for the log. A data set that gained items is refused."""
        position = state.get("data_position", {})
        saved_len, step = position.get("dataset_len"), int(state["step"])
        self.data_changes = list(position.get("changes", []))
        notes = []
        if saved_len is not None and saved_len < self.dataset_len:
            raise UserError(
                f"{source} was trained on a data set of {saved_len} items, this one has {self.dataset_len}: added "
                "items would change the run's data. Resume with the data it was trained on (items removed since, "
                "such as a bad image, are allowed), or start a new run from its weights with --init-from."
            )
        if saved_len is not None and saved_len > self.dataset_len:
            self.data_changes.append({"step": step, "dataset_len": self.dataset_len, "was": saved_len})
            notes.append(
                f"the data set has {self.dataset_len} items, {saved_len - self.dataset_len} fewer than the "
                f"{saved_len} of {source} (removed since): continuing at step {step} in the order of "
                f"{self.dataset_len} items. Each epoch's permutation is drawn for {self.dataset_len} items, "
                f"{self.steps_per_epoch} steps per epoch, so step {step} is in epoch {step // self.steps_per_epoch} "
                f"(was {position.get('epoch')}) and that epoch may repeat or miss a few items; the steps before "
                "are unchanged, and a resume from here on is exact"
            )
        load_model_state(self.model, state["model"], self.sharded, source)
        load_model_state(self.ema.model, state["ema"], self.sharded, f"{source} (EMA)")
        self.ema.num_updates = int(state["ema_updates"])
        profiles = state.get(PROFILES) or {}  # a profile an --allow-changes resume no longer tracks is dropped
        for key, profile in self.ema.profiles.items():
            load_model_state(profile.model, profiles[key], self.sharded, f"{source} (EMA profile {key})")
            profile.num_updates = self.ema.num_updates
        if self.projector is not None:
            if "repa_projector" not in state:
                raise UserError(f"{source} holds no REPA projector: resume it without --repa-encoder.")
            load_model_state(self.projector, state["repa_projector"], self.sharded, f"{source} (REPA projector)")
        load_optimizer_state(self.trained, self.optimizer, state["optimizer"], self.sharded)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        rng = state.get("rng", {}).get(str(runtime.rank))
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return notes
