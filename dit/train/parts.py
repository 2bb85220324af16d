"""The parts of a run, built from its config before its first step: the run folder locked and cleared, the
data, the model and its EMA placed over the processes, the state (restored on a resume), the ledger and the
in-loop evaluation. ``Trainer`` (``dit/train/trainer.py``) adds the step and the loop over them."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from dit.checkpoint import Checkpointer, remove_partial_checkpoints
from dit.checkpoint.lineage import begin_segment, plan_segment
from dit.io.atomic import atomic_write_bytes
from dit.model.dit import DiT
from dit.model.layers import attention_kernel
from dit.model.projector import RepaModel
from dit.runtime import Runtime
from dit.train.config import TrainConfig, resume_point
from dit.train.data import build_data, micro_batch
from dit.train.ema import EMA
from dit.train.hooks import EncodeImages
from dit.train.ledger import Ledger, StepCounters
from dit.train.parallel import parallelism
from dit.train.repa import Repa
from dit.train.state import TrainState


class RunParts:
    """A run's parts, each built once; a run that cannot start leaves its folder unlocked."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime, dataset=None):
        self.cfg, self.runtime = cfg, runtime
        self.out = Path(cfg.checkpoint.results_dir)
        self.ckpt_dir = cfg.checkpoint.folder
        notes = self._lock_run_folder()
        try:
            model_cfg, resume_from, ckpt = self._build_data(dataset, notes)
            model, trained, ema = self._build_model(model_cfg, ckpt, notes)
            line, off_line = self._build_state(model, trained, ema, resume_from, ckpt, notes)
            self._build_ledger(model, resume_from, notes)
            self._build_evaluation(model)
            if runtime.is_main:  # built: from here the run is this branch, and what is off its line is set aside
                for note in begin_segment(self.ckpt_dir, line, off_line):
                    self.ledger.sinks.info(note)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Unlock the run folder (at the run's end, or when it could not start)."""
        if self.lock is not None:
            self.lock.release()

    def _lock_run_folder(self) -> list[str]:
        """Rank 0 locks the run folder for the run's life (a second run into it is refused, every rank told),
        then clears what a killed run left: the lock file's record and partial checkpoint files."""
        rt, notes = self.runtime, []
        self.lock = rt.lock_folder(self.out, "training run", "wait for it, or pass another --results-dir")
        if rt.is_main:
            if held := self.lock.took_over:
                notes.append(
                    f"took over the lock of a run that is no longer running (pid {held.get('pid')} on {held.get('host')})"
                )
            files, size = remove_partial_checkpoints(self.ckpt_dir)
            if files:
                notes.append(
                    f"removed {files} partial checkpoint file(s), {size / 2**30:.3g} GiB, left by a killed save"
                )
        return notes

    def _build_data(self, dataset, notes: list[str]):
        """The data, the run's length and record, and the checkpoint it resumes from: (model config, path, payload)."""
        cfg, runtime = self.cfg, self.runtime
        batch = cfg.optim.global_batch_size
        self.micro = micro_batch(batch, runtime.world, cfg.optim.grad_accum_steps)  # before any building
        self.data = build_data(
            cfg.data,
            cfg.model.image_size,
            cfg.model.num_classes,
            dataset,
            runtime.device,
            features=cfg.repa_encoder.encoder is not None,
        )
        self.steps_per_epoch = max(1, len(self.data.dataset) // batch)  # the ragged tail of each is dropped
        self.total_steps = cfg.budget.max_steps
        if cfg.budget.epochs:  # the official train.py's unit: whole passes over the data
            self.total_steps = cfg.budget.epochs * self.steps_per_epoch
            notes.append(
                f"--epochs {cfg.budget.epochs} = {cfg.budget.epochs} x {self.steps_per_epoch:,} steps of {batch} "
                f"images = --max-steps {self.total_steps:,}"
            )
        # What the run is: config.yaml and every checkpoint. Its VAE is the data's (a data set given to train()
        # is what it is, whatever the data section says).
        self.record = cfg.record()
        self.record["data"]["vae"] = self.data.vae_spec or "none"
        model_cfg = cfg.model_config(self.data.in_channels, self.data.input_size)
        resume_from, ckpt, changed = resume_point(cfg, model_cfg, self.record)
        notes += [f"changed on this resume: {', '.join(changed)}"] if changed else []
        # the step must fit the device: checkpointing chosen, or the run refused, before anything is written
        kernel, accum, ema = cfg.parallel.attention, cfg.optim.grad_accum_steps, len(cfg.optim.ema_profiles or ())
        self.attention = attention_kernel(kernel, runtime.device.type, runtime.precision.compute_dtype)
        self.parallel = parallelism(cfg.parallel, runtime)
        self.checkpointed, why = self.parallel.fit(model_cfg, self.micro, accum, self.attention, ema)
        notes += [why] if why else []
        if runtime.is_main:
            atomic_write_bytes(self.out / "config.yaml", yaml.safe_dump(self.record, sort_keys=False).encode())
        return model_cfg, resume_from, ckpt

    def _build_model(self, model_cfg, ckpt, notes: list[str]):
        """The DiT (and REPA's projector), its EMA, placed over the processes; the step's hooks. Every rank
        builds the same weights: (model, what the optimizer steps, EMA)."""
        cfg, runtime, device = self.cfg, self.runtime, self.runtime.device
        torch.manual_seed(cfg.optim.seed)
        model = DiT.from_config(model_cfg).to(device).set_attention(cfg.parallel.attention)
        # REPA: the projector trains with the DiT (one module to parallelize and optimize); the encoder is frozen
        self.repa, trained = None, model
        if cfg.repa_encoder.encoder:
            self.repa = Repa(
                cfg.repa_encoder, cfg.repa, model_cfg, self.data.store_manifest, device, runtime.precision
            )
            trained = RepaModel(model, self.repa.projector(model_cfg).to(device), cfg.repa.depth)
        start = cfg.checkpoint
        if start.init_from and ckpt is None:  # a fine-tune's first start (its resumes: from its own checkpoints)
            from dit.train.init import init_from

            report = self.out / "init_from.json" if runtime.is_main else None
            notes.append(init_from(model, start.init_from, start.init_from_weights, report))
        ema = EMA(model, cfg.optim.ema_decay, cfg.optim.ema_warmup, cfg.optim.ema_profiles)  # copies, never run
        self.module = self.parallel.wrap(model, trained, ema.models, self.checkpointed)
        # side features in the step: REPA's targets come from the image before a VAE encodes it
        self.hooks = [self.repa] if self.repa else []
        if self.data.vae is not None:
            self.hooks.append(EncodeImages(self.data.vae, runtime.precision))
        return model, trained, ema

    def _build_state(self, model, trained, ema, resume_from, ckpt, notes: list[str]):
        """The state, restored from ``ckpt`` if any; the objective, the data order from the state's step.
        Returns the checkpoint lineage's (line, off line)."""
        cfg, runtime, device, optim = self.cfg, self.runtime, self.runtime.device, self.cfg.optim
        self.state = TrainState(
            model,
            ema,
            optim.optimizer(trained),
            runtime.precision.grad_scaler(),
            self.parallel.split,
            len(self.data.dataset),
            self.steps_per_epoch,
            trained,
            self.record,
            self.data.latent_norm.record() if self.data.latent_norm else None,
        )
        self.checkpointer = Checkpointer(cfg.checkpoint, runtime)
        self.saved_step = None  # the step of the newest checkpoint on disk, so that none is written twice
        if ckpt is not None:
            notes += self.checkpointer.restore(self.state, ckpt, source=str(resume_from))
            optim.reapply(self.state.optimizer)
            self.saved_step = self.state.step
        line, off_line = plan_segment(self.ckpt_dir, resume_from, ckpt) if runtime.is_main else (None, [])
        self.state.lineage = line
        self.objective = cfg.objective.build(model.config)
        self.objective.tables(device)  # uploaded once: a step makes no host-to-device copies of them
        self.loader = self.data.loader(optim, cfg.data.num_workers, runtime, self.state.step)
        self.rand_gen = torch.Generator(device=device)
        self.counters = StepCounters(device, alignment=self.repa is not None)
        return line, off_line

    def _build_ledger(self, model, resume_from, notes: list[str]) -> None:
        cfg = self.cfg
        self.ledger = Ledger(
            cfg.ledger,
            cfg.runtime,
            model=model,
            attention=self.attention,
            data=self.data,
            runtime=self.runtime,
            out=self.out,
            record=self.record,
            image_size=cfg.model.image_size,
            total_steps=self.total_steps,
            images_per_step=self.micro * cfg.optim.grad_accum_steps,
            start_step=self.state.step,
            repa=self.repa,
            dropped_steps=cfg.token_drop.dropped_steps(model.config, self.state.step),
        )
        self.ledger.report(self.parallel.memory_estimate)
        for note in notes + self.data.notes:
            self.ledger.sinks.info(note)
        self.resumed_from, self.resumed_step = resume_from, self.state.step
        if resume_from is not None:
            self.ledger.sinks.info(f"resumed from step {self.state.step} ({resume_from})")

    def _build_evaluation(self, model) -> None:
        """Grids and evaluations decode latents; a store's VAE is loaded for them (at start-up, where it can fail)."""
        cfg, device = self.cfg, self.runtime.device
        self.decoder = self.data.vae
        if self.decoder is None and self.data.vae_spec is not None and (cfg.ledger.sample_every or cfg.eval.every):
            from dit.data.vae import load_vae

            self.decoder = load_vae(self.data.vae_spec, device)
        self.evaluation = None
        if cfg.eval.every:
            from dit.eval.inloop import InLoopEval

            self.evaluation = InLoopEval(
                cfg.eval,
                cfg.eval_sampling,
                seed=cfg.optim.seed,
                image_size=cfg.model.image_size,
                objective=self.objective,
                runtime=self.runtime,
                model=model,
                vae=self.decoder,
                vae_spec=self.data.vae_spec,
                latent_norm=self.data.latent_norm,
            )
            self.ledger.sinks.info(self.evaluation.describe())
