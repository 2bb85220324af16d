"""The training loop: ``Trainer`` is a run's parts (``dit.train.parts``) plus the step and the loop, one screen long.

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

import torch

from dit.checkpoint import kept_checkpoints
from dit.io.atomic import CannotWrite
from dit.io.errors import UserError, unwrap_worker_error
from dit.io.progress import progress
from dit.runtime import Runtime, Stream, mix_seed
from dit.runtime.stop import EvalStopped, StopFlag, close_workers
from dit.train.config import TrainConfig
from dit.train.parts import RunParts
from dit.train.tokendrop import kept_tokens

SUSPECT_STEPS = 100  # a loss that turns non-finite this soon after a resume names the checkpoint as the suspect


class Trainer(RunParts):
    """The parts of a run, then the loop over them. ``train_step`` is public: tests and the benchmark time and
    probe exactly the step that training runs."""

    # ---- one step -------------------------------------------------------------------------------------

    def _randomness(self, step: int, shape):
        """The whole global batch's timesteps, noise, class dropout and the hooks' draws (a VAE's posterior sample),
        keyed by (seed, step): not the global RNG, which a data loader's start draws from."""
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
        """One optimizer step over this rank's micro-batches ``batches``, advancing ``state.step``, with nothing
        read back: the gradient norm (a device scalar) when clipping or ``log_step`` needs it, else None."""
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
        if scaler is not None:
            scaler.step(opt)  # skips non-finite steps on the device (it checks the gradients itself)
            scaler.update()
        else:  # a finite loss can still overflow in backward; the norm is the same on every rank (all-reduced)
            bad = bad | ~torch.isfinite(self.parallel.global_norm(grad_norm))
            if cfg.fused_optimizer:
                opt.found_inf = bad.float()  # the fused kernel skips the update (and its step count)
            if cfg.fused_optimizer or not bad.item():  # foreach AdamW cannot skip on the device: it syncs
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
            flag = contextlib.nullcontext(stop) if stop is not None else StopFlag(self.runtime.world)
            shown = cfg.ledger.progress and self.runtime.is_main
            with flag as stop, progress(max_steps, "train", initial=state.step, unit="step", enabled=shown) as bar:
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
                        ledger.aside(self.checkpointer.snapshot, state)
                    if ckpt_step:
                        ledger.aside(self.save)
                    if log_step:
                        self._report_saves()
                    if grid_every and state.step % grid_every == 0:
                        ledger.aside(self.sample_grid)
                    if eval_step:
                        ledger.aside(self._evaluate, stop)
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
            self.release()
        ledger.sinks.info(f"{status} at step {state.step}; results in {self.out}")
        ledger.close()
        return {"status": status, "signal": stopped_by, "step": state.step, "results_dir": str(self.out)}

    def _evaluate(self, stop) -> None:
        state = self.state
        try:
            scores = self.evaluation.run(self.parallel.whole(state.ema.of(self.cfg.eval.sigma_rel)), stop)
        except EvalStopped:
            self.ledger.sinks.info(f"evaluation at step {state.step} dropped: {stop.raised}")
        else:
            self.ledger.log_eval(state.step, scores)

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

    def _log(self, grad_norm, in_warmup: bool) -> None:
        state, scaler = self.state, self.state.scaler
        counters = self.counters.read(self.runtime)
        self.ledger.log(
            step=state.step,
            epoch=(state.step - 1) // self.steps_per_epoch,
            counters=counters,
            grad_norm=grad_norm,
            lr=self.cfg.optim.lr_at(state.step - 1, self.total_steps),
            in_warmup=in_warmup,
            loss_scale=float(scaler.get_scale()) if scaler is not None else None,
        )
        if (streak := counters["longest_nonfinite_streak"]) >= self.cfg.optim.max_nonfinite:
            self.ledger.aside(self.save)  # the skipped steps left the weights as before the first non-finite one
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
        """The checkpoints saved since the last report, in one line: at each log step and at the end of ``run``."""
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
        cfg, data = self.cfg, self.data
        sm = SamplingModel.from_objective(
            ema, "ema", cfg.model.image_size, self.decoder, data.vae_spec, self.objective, data.latent_norm
        )
        labels = list(range(min(mc.num_classes, 16)))
        seeds = [mix_seed(Stream.GRID, cfg.optim.seed, i) for i in range(len(labels))]
        guidance = 4.0 if mc.class_dropout_prob > 0 else 1.0  # no null label without class dropout
        sampler = Sampler(sm, 50, sm.objective.fast_sampler, guidance=Guidance(guidance))
        images = generate(sm, sampler, labels, seeds, precision=self.runtime.precision)
        grid = make_grid((images + 1) / 2, nrow=min(len(labels), 8))
        self.ledger.sinks.image("samples/ema", grid, self.state.step)


def train(cfg: TrainConfig, dataset=None) -> dict:
    """Train with ``cfg``; ``dataset`` (items (image CHW in [-1, 1], label)) replaces the configured data."""
    os.makedirs(cfg.checkpoint.results_dir, exist_ok=True)
    timeout = timedelta(minutes=cfg.runtime.dist_timeout_min)  # a rank 0 save inside a collective wait
    try:  # a stop in set-up: at the first step asked
        with Runtime.of(cfg.runtime, timeout=timeout) as runtime, StopFlag(runtime.world) as stop:
            return Trainer(cfg, runtime, dataset).run(stop)
    except CannotWrite as e:  # any write of the run (a checkpoint, a sink, a record): its line says what is kept
        raise e.keeping(kept_checkpoints(cfg.checkpoint.folder)) from None
