"""``TrainState``: everything a run needs to continue exactly, saved and loaded only through ``dit.checkpoint``.

Model, EMA, optimizer, loss scaler, step, every rank's RNG, the data position, and REPA's projector when the
run has one (sampling, export and ``--init-from`` read the model and EMA keys only). ``state_dict`` gathers
full (unsharded) tensors, with the optimizer keyed by parameter name, so a checkpoint resumes with or
without FSDP on any number of devices; under FSDP it is collective (every rank calls it, rank 0 keeps it).
"""

from __future__ import annotations

import torch
from torch import nn

from dit.errors import UserError
from dit.models import DiT
from dit.runtime import Runtime
from dit.train.ema import EMA
from dit.train.parallel import full_model_state, full_optimizer_state, load_model_state, load_optimizer_state


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
    ):
        """``trained``: what the optimizer steps, when more than the model (``dit.repa.RepaModel``)."""
        self.model, self.ema, self.optimizer, self.scaler = model, ema, optimizer, scaler
        self.sharded, self.dataset_len, self.steps_per_epoch = sharded, dataset_len, steps_per_epoch
        self.trained = model if trained is None else trained
        self.projector = getattr(self.trained, "projector", None)
        self.step = 0

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def state_dict(self, runtime: Runtime) -> dict:
        rng = runtime.gather_objects(
            {
                "cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            }
        )
        state = {
            "step": self.step,
            "model": full_model_state(self.model, self.sharded),
            "ema": full_model_state(self.ema.model, self.sharded),
            "ema_updates": self.ema.num_updates,
            "optimizer": full_optimizer_state(self.trained, self.optimizer, self.sharded),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": {str(r): s for r, s in enumerate(rng)},
            "data_position": {"step": self.step, "epoch": self.epoch, "dataset_len": self.dataset_len},
        }
        if self.projector is not None:
            state["repa_projector"] = full_model_state(self.projector, self.sharded)
        return state

    def load_state_dict(self, state: dict, runtime: Runtime, source: str = "checkpoint") -> None:
        saved_len = state.get("data_position", {}).get("dataset_len")
        if saved_len is not None and saved_len != self.dataset_len:
            raise UserError(
                f"{source} was trained on a data set of {saved_len} items, this one has {self.dataset_len}: the "
                "data order would change. Resume with the same data, or start a new run."
            )
        load_model_state(self.model, state["model"], self.sharded, source)
        load_model_state(self.ema.model, state["ema"], self.sharded, f"{source} (EMA)")
        self.ema.num_updates = int(state["ema_updates"])
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
