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
from pathlib import Path

import torch

from dit.checkpoint import remove_partial_checkpoints, save_training_checkpoint
from dit.config import to_dict
from dit.cost.memory import fewest_checkpointed_blocks, usable_memory
from dit.diffusion import create_diffusion
from dit.errors import UserError, unwrap_worker_error
from dit.models import DiT, attention_kernel
from dit.repa import RepaModel, repa_loss
from dit.runtime import Runtime, Stream, mix_seed
from dit.train.config import TrainConfig, parse_activation_checkpointing
from dit.train.data import build_data, micro_batch
from dit.train.ema import EMA
from dit.train.ledger import Ledger, StepCounters
from dit.train.parallel import data_parallel, shard
from dit.train.repa import Repa
from dit.train.state import TrainState, build_optimizer, resume_point


class Trainer:
    """The parts of a run (data, model, EMA, optimizer, parallelism, ledger), then the loop over them.

    ``train_step`` is public: tests and the benchmark time and probe exactly the step that training runs.
    """

    def __init__(self, cfg: TrainConfig, runtime: Runtime, dataset=None):
        self.cfg, self.runtime = cfg, runtime
        self.out = Path(cfg.results_dir)
        self.ckpt_dir = self.out / "checkpoints"
        notes = self._lock_run_folder()
        try:
            self._build(dataset, notes)
        except BaseException:
            if self.lock is not None:  # a run that could not start leaves the folder free
                self.lock.release()
            raise

    def _build(self, dataset, notes: list[str]) -> None:
        cfg, runtime = self.cfg, self.runtime
        device, world = runtime.device, runtime.world
        self.micro = micro_batch(cfg.global_batch_size, world, cfg.grad_accum_steps)  # before any building
        self.data = build_data(cfg, dataset, device)
        if cfg.epochs:  # the official train.py's unit: whole passes over the data, the ragged tail dropped
            per_epoch = max(1, len(self.data.dataset) // cfg.global_batch_size)
            cfg.max_steps = cfg.epochs * per_epoch
            notes.append(
                f"--epochs {cfg.epochs} = {cfg.epochs} x {per_epoch:,} steps of {cfg.global_batch_size} images = --max-steps {cfg.max_steps:,}"
            )
        model_cfg = cfg.model_config(self.data.in_channels, self.data.input_size)
        resume_from, ckpt = resume_point(cfg, self.ckpt_dir, model_cfg, self.data.vae_spec)

        torch.manual_seed(cfg.seed)
        model = DiT.from_config(model_cfg).to(device).set_attention(cfg.attention)
        # REPA: the projector trains with the DiT (one module for DDP and the optimizer); the encoder is frozen
        self.repa = Repa(cfg, model_cfg, self.data.store_manifest, device) if cfg.repa_encoder else None
        projector = self.repa.projector(model_cfg).to(device) if self.repa else None
        trained = RepaModel(model, projector, cfg.repa_depth) if self.repa else model
        if cfg.init_from and ckpt is None:  # a fine-tune's first start (its resumes come from its own checkpoints)
            from dit.train.init import init_from

            report = self.out / "init_from.json" if runtime.is_main else None
            notes.append(init_from(model, cfg.init_from, cfg.init_from_weights, report))
        self.attention = attention_kernel(cfg.attention, device.type, runtime.precision.compute_dtype)
        model.set_checkpointing(self._checkpointed_blocks(model))
        ema = EMA(model, cfg.ema_decay, cfg.ema_warmup)
        sharded = cfg.fsdp and world > 1
        if sharded:  # every rank built the same weights; the checkpoint, if any, is scattered into the shards
            shard(model)
            shard(ema.model)
            if projector is not None:
                shard(projector)
        optimizer = build_optimizer(trained, cfg.lr, cfg.weight_decay, cfg.fused_optimizer)
        n = len(self.data.dataset)
        self.state = TrainState(
            model, ema, optimizer, runtime.precision.grad_scaler(), sharded, n, max(1, n // cfg.global_batch_size),
            trained,
        )  # fmt: skip
        self.saved_step = None  # the step of the newest checkpoint on disk, so that none is written twice
        if ckpt is not None:
            self.state.load_state_dict(ckpt, runtime, source=str(resume_from))
            self.saved_step = self.state.step
        if cfg.compile:
            for block in model.blocks:
                block.compile()
        self.ddp_model = trained if sharded else data_parallel(trained, device, world)
        if cfg.objective == "flow":  # SiT's flow matching on the same model
            self.objective = cfg.transport()
        else:
            self.objective = create_diffusion(
                "",
                noise_schedule=cfg.noise_schedule,
                learn_sigma=cfg.learn_sigma,
                predict_xstart=cfg.predict_xstart,
            )
            self.objective.tables(device)  # uploaded once: a step makes no host-to-device copies of them
        self.order, self.loader = self.data.loader(cfg, runtime, self.state.step)
        self.rand_gen = torch.Generator(device=device)
        self.counters = StepCounters(device, alignment=self.repa is not None)
        done = self.state.step * self.micro * cfg.grad_accum_steps
        self.ledger = Ledger(cfg, model, self.attention, self.data, runtime, self.out, done, self.repa)
        self.ledger.report(self.micro, sharded)
        for note in notes + self.data.notes:
            self.ledger.sinks.info(note)
        if resume_from is not None:
            self.ledger.sinks.info(f"resumed from step {self.state.step} ({resume_from})")
        # Grids and evaluations decode latents; a store's VAE is loaded for them (at start-up, where it can fail).
        self.decoder = self.data.vae
        if self.decoder is None and self.data.vae_spec is not None and (cfg.sample_every or cfg.eval_every):
            from dit.vae import load_vae

            self.decoder = load_vae(self.data.vae_spec, device)
        self.evaluation = None
        if cfg.eval_every:
            from dit.eval.inloop import InLoopEval

            self.evaluation = InLoopEval(cfg, runtime, model_cfg, self.decoder, self.data.vae_spec)
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

    def _checkpointed_blocks(self, model: DiT) -> int:
        policy = parse_activation_checkpointing(self.cfg.activation_checkpointing)
        if policy == "all":
            return model.config.depth
        if policy != "auto":
            if policy > model.config.depth:
                raise UserError(f"--activation-checkpointing {policy} exceeds the depth ({model.config.depth}).")
            return policy
        if self.runtime.device.type != "cuda":  # no device limit to fit: recompute nothing
            return 0
        capacity = torch.cuda.get_device_properties(self.runtime.device).total_memory
        return fewest_checkpointed_blocks(
            model.config,
            self.micro,
            usable_memory(capacity, self.cfg.memory_reserve_gib),
            precision=self.cfg.precision,
            world_size=self.runtime.world,
            sharding="fsdp" if self.cfg.fsdp and self.runtime.world > 1 else "ddp",
            gradient_as_bucket_view=True,
            attention="explicit" if self.attention in ("explicit", "math") else "fused",
        )

    # ---- one step -------------------------------------------------------------------------------------

    def _randomness(self, step: int, shape):
        """Timesteps, noise, class dropout and (encoding on the fly) the posterior draw of the whole global
        batch for this step, identical on every rank: the VAE's sample too is keyed by (seed, step), so a
        resumed run or another world size encodes the same latents (the global RNG is not: a data loader's
        start draws from it)."""
        g = self.rand_gen.manual_seed(mix_seed(Stream.STEP, self.cfg.seed, step))
        b, device = self.cfg.global_batch_size, self.runtime.device
        if self.cfg.objective == "flow":  # continuous times in [0, 1], 1 = data
            t = self.objective.sample_t(b, g, device)
        else:
            t = torch.randint(0, self.objective.num_timesteps, (b,), generator=g, device=device)
        noise = torch.randn((b, *shape), generator=g, device=device)
        drop = (torch.rand(b, generator=g, device=device) < self.cfg.class_dropout_prob).long()
        eps = torch.randn((b, *shape), generator=g, device=device) if self.data.vae is not None else None
        return t, noise, drop, eps

    def _model_fn(self, x, t, **kwargs):
        """The (data-parallel) model under autocast, returning float32 so the loss math stays in float32; with
        REPA, the projected tokens of the same forward are kept for the alignment loss."""
        with self.runtime.precision.autocast():
            out = self.ddp_model(x, t, **kwargs)
        if self.repa is not None:
            out, self._projected = out
        return out.float()

    def train_step(self, batches, log_step: bool = False):
        """One optimizer step over this rank's micro-batches ``batches``; advances ``state.step``.

        Returns the gradient norm (a device scalar) when clipping or ``log_step`` needs it, else None. A
        non-finite loss skips the update on the device (fused AdamW's ``found_inf``, the scaler, 0/1 EMA
        weights), so nothing is read back.
        """
        cfg, state, device = self.cfg, self.state, self.runtime.device
        model, opt, scaler = state.model, state.optimizer, state.scaler
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(state.step)
        mc = model.config
        shape = (mc.in_channels, mc.input_size, mc.input_size)
        t_all, noise_all, drop_all, eps_all = self._randomness(state.step, shape)
        total = align_total = None
        for m, (x, y, *stored) in enumerate(batches):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lo = (self.runtime.rank * cfg.grad_accum_steps + m) * self.micro
            sl = slice(lo, lo + self.micro)
            if self.repa is not None:  # the encoder sees the image the DiT's input comes from, before any VAE
                with self.runtime.precision.autocast():
                    target = self.repa.targets(x, stored[0].to(device, non_blocking=True) if stored else None)
            if self.data.vae is not None:
                from dit.vae import encode

                with torch.no_grad():
                    x = encode(self.data.vae, x, eps=eps_all[sl])
            kwargs = {"y": y, "force_drop_ids": drop_all[sl]} if mc.class_dropout_prob > 0 else {"y": y}
            last = m == len(batches) - 1
            if state.sharded:
                model.set_requires_gradient_sync(last)
                if state.projector is not None:
                    state.projector.set_requires_gradient_sync(last)
            no_sync = not last and not state.sharded and self.ddp_model is not state.trained
            with self.ddp_model.no_sync() if no_sync else contextlib.nullcontext():
                terms = self.objective.training_losses(self._model_fn, x, t_all[sl], kwargs, noise=noise_all[sl])
                loss = objective = terms["loss"].mean() / cfg.grad_accum_steps
                if self.repa is not None:  # REPA: + coeff x (minus the cosine similarity, mean over tokens)
                    align = repa_loss(self._projected, target).mean() / cfg.grad_accum_steps
                    self._projected = None  # the graph holds it until backward; nothing else should
                    loss = objective + self.repa.coeff * align
                    align_total = align.detach() if align_total is None else align_total + align.detach()
                (scaler.scale(loss) if scaler is not None else loss).backward()
            total = objective.detach() if total is None else total + objective.detach()
        bad = ~torch.isfinite(total if align_total is None else total + align_total)
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
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: collective
            bad = bad | ~torch.isfinite(norm)  # the same on every rank: the gradients were all-reduced
        if scaler is not None:
            scaler.step(opt)  # skips non-finite steps on the device
            scaler.update()
        elif cfg.fused_optimizer:
            opt.found_inf = bad.float()  # the fused kernel skips the update (and its step count)
            opt.step()
        elif not bad.item():  # foreach AdamW cannot skip on the device: this path syncs every step
            opt.step()
        opt.zero_grad(set_to_none=True)
        state.ema.update(model, apply=(~bad).float())
        self.counters.add(total, bad, align_total)
        state.step += 1
        return grad_norm

    # ---- the loop -------------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg, state, ledger = self.cfg, self.state, self.ledger
        warmup_until = state.step + cfg.mfu_warmup_steps
        it, status, stopped_by = iter(self.loader), "finished", None
        try:
            with self.runtime.stop_flag() as stop, self._progress() as bar:
                state.model.train()
                ledger.start_window()
                while state.step < cfg.max_steps:
                    start = time.perf_counter()
                    batches = self._next_batches(it)
                    wait = time.perf_counter() - start
                    log_step = (state.step + 1) % cfg.log_every == 0 or state.step + 1 == cfg.max_steps
                    grad_norm = self.train_step(batches, log_step)
                    ledger.count(self.micro * cfg.grad_accum_steps, wait)
                    bar.update(1)
                    if log_step:
                        self._log(grad_norm, in_warmup=state.step <= warmup_until)
                    if state.step == warmup_until:  # after this step's log: MFU windows start here
                        ledger.start_window()
                    if state.step % cfg.ckpt_every == 0 and state.step < cfg.max_steps:
                        with ledger.paused():
                            self.save()
                    if cfg.sample_every and state.step % cfg.sample_every == 0:
                        with ledger.paused():
                            self.sample_grid()
                    if cfg.eval_every and (state.step % cfg.eval_every == 0 or state.step == cfg.max_steps):
                        with ledger.paused():
                            ledger.log_eval(state.step, self.evaluation.run(self._whole(state.ema.model)))
                    if stop.should_stop():
                        status, stopped_by = f"stopped by {stop.raised}", stop.raised
                        break
                self.save()
        finally:
            if self.lock is not None:
                self.lock.release()
        ledger.sinks.info(f"{status} at step {state.step}; results in {self.out}")
        ledger.close()
        return {"status": status, "signal": stopped_by, "step": state.step, "results_dir": str(self.out)}

    def _next_batches(self, it) -> list:
        try:
            return [next(it) for _ in range(self.cfg.grad_accum_steps)]
        except UserError as e:  # an unreadable image: keep the work done so far, then say which file
            # With several processes the others are mid-step: no collective save. Before step 1 there is
            # nothing to keep, and a step-0 checkpoint would only make the rerun need --resume.
            if self.runtime.world == 1 and self.state.step > 0:
                self.save()
            raise unwrap_worker_error(e) from None

    def _progress(self):
        if not (self.cfg.progress and self.runtime.is_main):
            return contextlib.nullcontext(_NoBar())
        from tqdm.auto import tqdm

        return tqdm(total=self.cfg.max_steps, initial=self.state.step, desc="train", dynamic_ncols=True)

    def _log(self, grad_norm, in_warmup: bool) -> None:
        state, scaler = self.state, self.state.scaler
        counters = self.counters.read(self.runtime)
        self.ledger.log(
            state.step,
            self.order.epoch_of(state.step - 1),
            counters,
            grad_norm,
            self.cfg.lr_at(state.step - 1),
            in_warmup,
            float(scaler.get_scale()) if scaler is not None else None,
        )
        if counters["longest_nonfinite_streak"] >= self.cfg.max_nonfinite:  # skipped steps left the weights alone
            with self.ledger.paused():
                self.save()
            raise UserError(
                f"the loss was non-finite for {counters['longest_nonfinite_streak']} steps in a row (by step "
                f"{state.step}); "
                "the last good state is saved. Lower --lr, set --grad-clip, or use --precision bf16/fp32."
            )

    def save(self) -> None:
        """The state as one checkpoint file, written atomically by rank 0 (collective under FSDP); a step that
        is already on disk (a stop on a checkpoint step, a finished run resumed) is not written again."""
        if self.saved_step == self.state.step:
            return
        payload = self.state.state_dict(self.runtime)
        if self.runtime.is_main:
            payload["config"] = {**to_dict(self.cfg), "vae": self.data.vae_spec}
            payload["model_config"] = self.state.model.config.to_dict()
            path = save_training_checkpoint(self.ckpt_dir, self.state.step, payload, self.cfg.keep_last)
            self.ledger.sinks.info(f"saved checkpoint {path}")
        self.saved_step = self.state.step
        self.runtime.barrier()

    def _whole(self, model: DiT, every_rank: bool = True) -> DiT | None:
        """``model`` itself, or under FSDP an unsharded copy on every rank (or on rank 0 only, None elsewhere);
        every rank must call it, gathering is collective."""
        if not self.state.sharded:
            return model
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)  # offload: rank 0 only
        weights = get_model_state_dict(model, options=options)
        if not (every_rank or self.runtime.is_main):
            return None
        whole = DiT.from_config(model.config).to(self.runtime.device).eval()
        whole.load_state_dict(weights)
        return whole

    def sample_grid(self) -> None:
        """A grid from the EMA weights (DDIM-50, guidance 4) for TensorBoard, one image per class shown."""
        from torchvision.utils import make_grid

        from dit.sample.generate import Sampler, SamplingModel, generate

        ema, mc = self._whole(self.state.ema.model, every_rank=False), self.state.model.config
        if not self.runtime.is_main:
            return
        cfg = self.cfg
        sm = SamplingModel.from_run(ema, "ema", cfg.image_size, self.decoder, self.data.vae_spec, to_dict(cfg))
        labels = list(range(min(mc.num_classes, 16)))
        seeds = [mix_seed(Stream.GRID, cfg.seed, i) for i in range(len(labels))]
        guidance = 4.0 if mc.class_dropout_prob > 0 else 1.0  # no null label without class dropout
        sampler = Sampler(sm, 50, "ddim" if sm.transport is None else "ode")
        images = generate(sm, sampler, labels, seeds, guidance, 3, self.runtime.precision)
        self.ledger.sinks.image(
            "samples/ema", make_grid((images + 1) / 2, nrow=min(len(labels), 8)), self.state.step
        )


class _NoBar:
    def update(self, n: int) -> None:
        pass


def train(cfg: TrainConfig, dataset=None) -> dict:
    """Train with ``cfg``; ``dataset`` (items (image CHW in [-1, 1], label)) replaces the configured data."""
    os.makedirs(cfg.results_dir, exist_ok=True)
    with Runtime(cfg.device, cfg.precision) as runtime:
        return Trainer(cfg, runtime, dataset).run()
