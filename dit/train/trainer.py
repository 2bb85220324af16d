"""The training loop: a ``Trainer`` builds a run from its config, then ``run`` trains it, one screen long.

Everything random in a step (timesteps, noise, class dropout, augmentation) is drawn from streams keyed by
(seed, step) and sliced by global sample position, so a run is bit-identical across resumes and equal (to
float tolerance) across world sizes. A step reads nothing back from the device; the ledger reads the
device counters at log steps, the only host syncs.
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import yaml

from dit.checkpoint import Checkpointer, kept_checkpoints, remove_partial_checkpoints
from dit.checkpoint.lineage import begin_segment, plan_segment
from dit.io.atomic import CannotWrite, atomic_write
from dit.io.errors import UserError, unwrap_worker_error
from dit.io.progress import progress
from dit.model.dit import DiT
from dit.model.layers import attention_kernel
from dit.model.projector import RepaModel
from dit.runtime import Runtime, Stream, mix_seed
from dit.runtime.stop import EvalStopped, StopFlag, close_workers
from dit.train.config import TrainConfig, resume_point
from dit.train.data import build_data, micro_batch
from dit.train.ema import EMA
from dit.train.hooks import EncodeImages
from dit.train.ledger import Ledger, StepCounters
from dit.train.parallel import parallelism
from dit.train.repa import Repa
from dit.train.state import TrainState
from dit.train.tokendrop import kept_tokens

# A loss that turns non-finite this soon after a resume names the checkpoint as the suspect: a 6e31 weight
# (one flipped exponent bit) kept the loss finite for 3 steps in the tests, then NaN.
SUSPECT_STEPS = 100


class Trainer:
    """The parts of a run (data, model, EMA, optimizer, parallelism, ledger), then the loop over them.

    ``train_step`` is public: tests and the benchmark time and probe exactly the step that training runs.
    """

    def __init__(self, cfg: TrainConfig, runtime: Runtime, dataset=None):
        self.cfg, self.runtime = cfg, runtime
        self.out = Path(cfg.checkpoint.results_dir)
        self.ckpt_dir = cfg.checkpoint.folder
        notes = self._lock_run_folder()
        try:
            self._build(dataset, notes)
        except BaseException:
            if self.lock is not None:  # a run that could not start leaves the folder free
                self.lock.release()
            raise

    def _build(self, dataset, notes: list[str]) -> None:
        model_cfg, resume_from, ckpt = self._build_data(dataset, notes)
        model, trained, ema = self._build_model(model_cfg, ckpt, notes)
        line, off_line = self._build_state(model, trained, ema, resume_from, ckpt, notes)
        self._build_ledger(model, resume_from, notes)
        self._build_evaluation(model)
        if self.runtime.is_main:  # built: from here the run is this branch, and what is off its line is set aside
            for note in begin_segment(self.ckpt_dir, line, off_line):
                self.ledger.sinks.info(note)

    def _build_data(self, dataset, notes: list[str]):
        """The data, the run's length and record, and the checkpoint it resumes from: (model config, path, payload)."""
        cfg, runtime = self.cfg, self.runtime
        batch = cfg.optim.global_batch_size
        self.micro = micro_batch(batch, runtime.world, cfg.optim.grad_accum_steps)  # before any building
        self.data = build_data(
            cfg.data, cfg.model.image_size, cfg.model.num_classes, dataset, runtime.device,
            features=cfg.repa_encoder.encoder is not None,
        )  # fmt: skip
        n = len(self.data.dataset)
        self.total_steps = cfg.budget.steps(n, batch)
        if cfg.budget.epochs:  # the official train.py's unit: whole passes over the data, the ragged tail dropped
            notes.append(
                f"--epochs {cfg.budget.epochs} = {cfg.budget.epochs} x {max(1, n // batch):,} steps of {batch} "
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
            text = yaml.safe_dump(self.record, sort_keys=False)
            atomic_write(self.out / "config.yaml", lambda f: f.write(text.encode()))
        return model_cfg, resume_from, ckpt

    def _build_model(self, model_cfg, ckpt, notes: list[str]):
        """The DiT (and REPA's projector), its EMA, placed over the processes; the step's hooks. Every rank
        builds the same weights: (model, what the optimizer steps, EMA)."""
        cfg, runtime, device = self.cfg, self.runtime, self.runtime.device
        torch.manual_seed(cfg.optim.seed)
        model = DiT.from_config(model_cfg).to(device).set_attention(cfg.parallel.attention)
        # REPA: the projector trains with the DiT (one module to parallelize and optimize); the encoder is frozen
        self.repa = None
        if cfg.repa_encoder.encoder:
            self.repa = Repa(
                cfg.repa_encoder, cfg.repa, model_cfg, self.data.store_manifest, device, runtime.precision
            )
        projector = self.repa.projector(model_cfg).to(device) if self.repa else None
        trained = RepaModel(model, projector, cfg.repa.depth) if self.repa else model
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
        n = len(self.data.dataset)
        self.state = TrainState(
            model, ema, optim.optimizer(trained), runtime.precision.grad_scaler(), self.parallel.split, n,
            max(1, n // optim.global_batch_size), trained, self.record,
            self.data.latent_norm.record() if self.data.latent_norm else None,
        )  # fmt: skip
        self.checkpointer = Checkpointer(cfg.checkpoint, runtime)
        self.saved_step = None  # the step of the newest checkpoint on disk, so that none is written twice
        if ckpt is not None:
            notes += self.checkpointer.restore(self.state, ckpt, source=str(resume_from))
            optim.reapply(self.state.optimizer)
            self.saved_step = self.state.step
        line, off_line = plan_segment(self.ckpt_dir, resume_from, ckpt) if runtime.is_main else (None, [])
        self.state.lineage = line
        model_cfg = model.config
        self.objective = cfg.objective.build(model_cfg)
        self.objective.tables(device)  # uploaded once: a step makes no host-to-device copies of them
        self.order, self.loader = self.data.loader(optim, cfg.data.num_workers, runtime, self.state.step)
        self.rand_gen = torch.Generator(device=device)
        self.counters = StepCounters(device, alignment=self.repa is not None)
        return line, off_line

    def _build_ledger(self, model, resume_from, notes: list[str]) -> None:
        cfg = self.cfg
        per_step = self.micro * cfg.optim.grad_accum_steps
        done = self.state.step * per_step
        dropped = cfg.token_drop.dropped_steps(model.config, self.state.step) * per_step
        self.ledger = Ledger(
            cfg.ledger, cfg.runtime, model=model, attention=self.attention, data=self.data, runtime=self.runtime,
            out=self.out, record=self.record, image_size=cfg.model.image_size, total_steps=self.total_steps,
            local_images_done=done, start_step=self.state.step, repa=self.repa, dropped_images_done=dropped,
        )  # fmt: skip
        self.ledger.report(self.micro, self.parallel.split)
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
                cfg.eval, cfg.eval_sampling, seed=cfg.optim.seed, image_size=cfg.model.image_size,
                objective=self.objective, runtime=self.runtime, model=model, vae=self.decoder,
                vae_spec=self.data.vae_spec, latent_norm=self.data.latent_norm,
            )  # fmt: skip
            self.ledger.sinks.info(self.evaluation.describe())

    def _lock_run_folder(self) -> list[str]:
        """Rank 0 locks the run folder for the run's life (a second run into it is refused, every rank told),
        then clears what a killed run left: the lock file's record and partial checkpoint files."""
        rt, notes, self.lock = self.runtime, [], None
        self.lock = rt.lock_folder(self.out, "training run", "wait for it, or pass another --results-dir")
        if rt.is_main:
            if self.lock.took_over:
                held = self.lock.took_over
                notes.append(
                    f"took over the lock of a run that is no longer running (pid {held.get('pid')} on {held.get('host')})"
                )
            files, size = remove_partial_checkpoints(self.ckpt_dir)
            if files:
                notes.append(
                    f"removed {files} partial checkpoint file(s), {size / 2**30:.3g} GiB, left by a killed save"
                )
        return notes

    # ---- one step -------------------------------------------------------------------------------------

    def _randomness(self, step: int, shape):
        """Timesteps, noise, class dropout and the hooks' draws (a VAE's posterior sample) of the whole global
        batch for this step, identical on every rank: keyed by (seed, step), so a resumed run or another world
        size draws the same (the global RNG is not: a data loader's start draws from it)."""
        g = self.rand_gen.manual_seed(mix_seed(Stream.STEP, self.cfg.optim.seed, step))
        b, device = self.cfg.optim.global_batch_size, self.runtime.device
        t = self.objective.sample_t(b, g, device)  # diffusion: integer steps; flow: times in [0, 1], 1 = data
        noise = torch.randn((b, *shape), generator=g, device=device)
        drop = (torch.rand(b, generator=g, device=device) < self.cfg.model.class_dropout_prob).long()
        for hook in self.hooks:
            hook.draw(g, b, shape, device)
        return t, noise, drop

    def _model_fn(self, x, t, **kwargs):
        """The (data-parallel) model under autocast, returning float32 so the loss math stays in float32; the
        hooks take what else the forward returned (REPA's projected tokens)."""
        with self.runtime.precision.autocast():
            out = self.module(x, t, **kwargs)
        for hook in self.hooks:
            out = hook.output(out)
        return out.float()

    def train_step(self, batches, log_step: bool = False):
        """One optimizer step over this rank's micro-batches ``batches``; advances ``state.step``.

        Returns the gradient norm (a device scalar) when clipping or ``log_step`` needs it, else None. A
        non-finite loss skips the update on the device (fused AdamW's ``found_inf``, the scaler, 0/1 EMA
        weights), so nothing is read back.
        """
        cfg, state, device = self.cfg.optim, self.state, self.runtime.device
        for group in state.optimizer.param_groups:
            group["lr"] = cfg.lr_at(state.step, self.total_steps)
        mc = state.model.config
        shape = (mc.in_channels, mc.input_size, mc.input_size)
        t_all, noise_all, drop_all = self._randomness(state.step, shape)
        kept_all = None
        if self.cfg.token_drop.dropping(mc, state.step):  # its own stream: the other draws stay as they were
            kept_all = kept_tokens(mc, cfg.seed, state.step, cfg.global_batch_size, device)
        total = aux_total = None
        for m, (x, y, *stored) in enumerate(batches):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lo = (self.runtime.rank * cfg.grad_accum_steps + m) * self.micro
            sl = slice(lo, lo + self.micro)
            for hook in self.hooks:  # in order: REPA's encoder sees the image before a VAE encodes it
                x = hook.prepare(x, stored, sl)
            kwargs = {"y": y, "force_drop_ids": drop_all[sl]} if mc.class_dropout_prob > 0 else {"y": y}
            if kept_all is not None:
                kwargs["kept"] = kept_all[sl]
            with self.parallel.sync_gradients(last=m == len(batches) - 1):
                terms = self.objective.training_losses(self._model_fn, x, t_all[sl], kwargs, noise=noise_all[sl])
                loss = objective = terms["loss"].mean() / cfg.grad_accum_steps
                for term, value in filter(None, (hook.loss(cfg.grad_accum_steps) for hook in self.hooks)):
                    loss = loss + term
                    aux_total = value.detach() if aux_total is None else aux_total + value.detach()
                (state.scaler.scale(loss) if state.scaler is not None else loss).backward()
            total = objective.detach() if total is None else total + objective.detach()
        return self._update(total, aux_total, log_step)

    def _update(self, total, aux_total, log_step: bool):
        """The optimizer and EMA step after the micro-batches' backward, skipped on the device where the loss
        (``total``, with the hooks' ``aux_total``) or the gradients are non-finite on any rank."""
        cfg, state = self.cfg.optim, self.state
        opt, scaler = state.optimizer, state.scaler
        bad = ~torch.isfinite(total if aux_total is None else total + aux_total)
        if self.runtime.world > 1:  # one rank's NaN reaches every rank's gradients: all must skip together
            bad = self.runtime.all_reduce(bad.int(), op="max").bool()
        grad_norm = None
        if scaler is not None and (cfg.grad_clip > 0 or log_step):
            scaler.unscale_(opt)
        params = [p for p in state.trained.parameters() if p.grad is not None]
        if cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        elif scaler is None or log_step:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if scaler is None:  # a finite loss can still overflow in backward; fp16's scaler checks that itself
            # the same on every rank: the gradients were all-reduced
            bad = bad | ~torch.isfinite(self.parallel.global_norm(grad_norm))
        if scaler is not None:
            scaler.step(opt)  # skips non-finite steps on the device
            scaler.update()
        elif cfg.fused_optimizer:
            opt.found_inf = bad.float()  # the fused kernel skips the update (and its step count)
            opt.step()
        elif not bad.item():  # foreach AdamW cannot skip on the device: this path syncs every step
            opt.step()
        opt.zero_grad(set_to_none=True)
        state.ema.update(state.model, apply=(~bad).float())
        self.counters.add(total, bad, aux_total)
        state.step += 1
        return grad_norm

    # ---- the loop -------------------------------------------------------------------------------------

    def run(self, stop: StopFlag | None = None) -> dict:
        cfg, state, ledger = self.cfg, self.state, self.ledger
        max_steps, log_every = self.total_steps, cfg.ledger.log_every
        grid_every, eval_every = cfg.ledger.sample_every, cfg.eval.every
        warmup_until = state.step + cfg.ledger.mfu_warmup_steps
        it, status, stopped_by = iter(self.loader), "finished", None
        try:
            flag = contextlib.nullcontext(stop) if stop is not None else self.runtime.stop_flag()
            with flag as stop, self._progress() as bar:
                state.model.train()
                ledger.start_window()
                while state.step < max_steps:
                    start = time.perf_counter()
                    batches = self._next_batches(it, stop)
                    if batches is None:  # a loader worker died of the stop signal: a stop, not a crash
                        status, stopped_by = f"stopped by {stop.raised}", stop.raised
                        break
                    wait = time.perf_counter() - start
                    dropping = cfg.token_drop.dropping(state.model.config, state.step)
                    log_step = (state.step + 1) % log_every == 0 or state.step + 1 == max_steps
                    grad_norm = self.train_step(batches, log_step)
                    ledger.count(self.micro * cfg.optim.grad_accum_steps, wait, dropping)
                    bar.update(1)
                    if log_step:
                        self._log(grad_norm, in_warmup=state.step <= warmup_until)
                    if state.step == warmup_until:  # after this step's log: MFU windows start here
                        ledger.start_window()
                    ckpt_step = state.step % cfg.checkpoint.ckpt_every == 0 and state.step < max_steps
                    eval_step = bool(eval_every) and (state.step % eval_every == 0 or state.step == max_steps)
                    # the snapshot first: a checkpoint is never newer than the snapshots its run needs
                    if self.checkpointer.snapshot_due(state, last=state.step == max_steps):
                        with ledger.paused():
                            self.checkpointer.snapshot(state)
                    if ckpt_step:
                        with ledger.paused():
                            self.save()
                    if log_step:
                        self._report_saves()
                    if grid_every and state.step % grid_every == 0:
                        with ledger.paused():
                            self.sample_grid()
                    if eval_step:
                        with ledger.paused():
                            try:
                                scores = self.evaluation.run(
                                    self.parallel.whole(state.ema.of(cfg.eval.sigma_rel)), stop
                                )
                            except EvalStopped:
                                ledger.sinks.info(f"evaluation at step {state.step} dropped: {stop.raised}")
                            else:
                                ledger.log_eval(state.step, scores)
                    # ranks ask each other only where they sync anyway (StopFlag): within --log-every steps
                    self.checkpointer.check(everyone=log_step or ckpt_step or eval_step)
                    if stop.should_stop(everyone=log_step or ckpt_step or eval_step):
                        status, stopped_by = f"stopped by {stop.raised}", stop.raised
                        break
                self.save()
                self.checkpointer.wait()  # an --async-checkpoint save still being written
        finally:
            self._report_saves()  # the final save, a stop's, or the one before an error: named in the log
            close_workers(it)
            if self.lock is not None:
                self.lock.release()
        ledger.sinks.info(f"{status} at step {state.step}; results in {self.out}")
        ledger.close()
        return {"status": status, "signal": stopped_by, "step": state.step, "results_dir": str(self.out)}

    def _next_batches(self, it, stop) -> list | None:
        try:
            return [next(it) for _ in range(self.cfg.optim.grad_accum_steps)]
        except RuntimeError as e:
            # Workers ignore SIGTERM/SIGINT (worker_init), but one signalled before its init ran dies of it:
            # after the flag is set that is the stop the signal asked for (None), otherwise a real failure.
            if "DataLoader worker" in str(e) and stop.raised:
                return None
            raise
        except UserError as e:  # an unreadable image: keep the work done so far, then say which file
            # With several processes the others are mid-step: no collective save. Before step 1 there is
            # nothing to keep, and a step-0 checkpoint would only make the rerun need --resume.
            if self.runtime.world == 1 and self.state.step > 0:
                self.save()
            raise unwrap_worker_error(e) from None

    def _progress(self):
        enabled = self.cfg.ledger.progress and self.runtime.is_main
        return progress(self.total_steps, "train", initial=self.state.step, unit="step", enabled=enabled)

    def _log(self, grad_norm, in_warmup: bool) -> None:
        state, scaler = self.state, self.state.scaler
        counters = self.counters.read(self.runtime)
        self.ledger.log(
            step=state.step,
            epoch=self.order.epoch_of(state.step - 1),
            counters=counters,
            grad_norm=grad_norm,
            lr=self.cfg.optim.lr_at(state.step - 1, self.total_steps),
            in_warmup=in_warmup,
            loss_scale=float(scaler.get_scale()) if scaler is not None else None,
        )
        if counters["longest_nonfinite_streak"] >= self.cfg.optim.max_nonfinite:  # skipped steps left the weights
            streak = counters["longest_nonfinite_streak"]
            with self.ledger.paused():
                self.save()  # the skipped steps left the weights as they were before the first non-finite one
            began = state.step - streak + 1
            if self.resumed_from is not None and began - self.resumed_step <= SUSPECT_STEPS:
                # soon after a resume: the weights it resumed from are the suspect, not the recipe
                raise UserError(
                    f"the loss turned non-finite {began - self.resumed_step} steps after resuming from "
                    f"{self.resumed_from}: that checkpoint is the suspect (`sha256sum -c "
                    f"{self.resumed_from}.sha256` where it has one); resume from an older one with --resume PATH."
                )
            raise UserError(
                f"the loss was non-finite for {streak} steps in a row (by step {state.step}); "
                "the last good state is saved. Lower --lr, set --grad-clip, or use --precision bf16/fp32."
            )

    def save(self) -> None:
        """The state as a checkpoint (collective; ``dit.checkpoint.Checkpointer`` picks the form); a step that is
        already saved (a stop on a checkpoint step, a finished run resumed) is not written again."""
        if self.saved_step != self.state.step:
            self.checkpointer.save(self.state)
            self.saved_step = self.state.step

    def _report_saves(self) -> None:
        """The checkpoints saved since the last report, in one line: at each log step and at the end of ``run``
        (``--ckpt-every 1`` printed a line per step)."""
        saves = self.checkpointer.take_saved()
        if len(saves) == 1:
            self.ledger.sinks.info(f"saved checkpoint {saves[0][1]}")
        elif saves:
            self.ledger.sinks.info(
                f"saved {len(saves)} checkpoints, steps {saves[0][0]} to {saves[-1][0]}; the newest {saves[-1][1]}"
            )

    def sample_grid(self) -> None:
        """A grid from the EMA weights (DDIM-50, guidance 4) for TensorBoard, one image per class shown."""
        from torchvision.utils import make_grid

        from dit.sample.generate import Guidance, Sampler, SamplingModel, generate

        ema, mc = self.parallel.whole(self.state.ema.model, every_rank=False), self.state.model.config
        if not self.runtime.is_main:
            return
        cfg = self.cfg
        sm = SamplingModel.from_objective(
            ema,
            "ema",
            cfg.model.image_size,
            self.decoder,
            self.data.vae_spec,
            self.objective,
            self.data.latent_norm,
        )
        labels = list(range(min(mc.num_classes, 16)))
        seeds = [mix_seed(Stream.GRID, cfg.optim.seed, i) for i in range(len(labels))]
        guidance = 4.0 if mc.class_dropout_prob > 0 else 1.0  # no null label without class dropout
        sampler = Sampler(sm, 50, sm.objective.fast_sampler, guidance=Guidance(guidance))
        images = generate(sm, sampler, labels, seeds, precision=self.runtime.precision)
        self.ledger.sinks.image(
            "samples/ema", make_grid((images + 1) / 2, nrow=min(len(labels), 8)), self.state.step
        )


def train(cfg: TrainConfig, dataset=None) -> dict:
    """Train with ``cfg``; ``dataset`` (items (image CHW in [-1, 1], label)) replaces the configured data."""
    os.makedirs(cfg.checkpoint.results_dir, exist_ok=True)
    timeout = timedelta(minutes=cfg.runtime.dist_timeout_min)  # a rank 0 save inside a collective wait
    try:
        with (
            Runtime.of(cfg.runtime, timeout=timeout) as runtime,
            runtime.stop_flag() as stop,
        ):  # a stop in set-up: at the first step asked
            return Trainer(cfg, runtime, dataset).run(stop)
    except CannotWrite as e:  # any write of the run (a checkpoint, a sink, a record): its line says what is kept
        raise e.keeping(kept_checkpoints(cfg.checkpoint.folder)) from None
