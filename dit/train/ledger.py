"""The run's ledger: a step's cost, the meter that turns host-side counts into MFU/HFU per window, and the sinks;
the loop calls ``count`` each step and ``log`` at log steps, and nothing here touches the device in between."""

from __future__ import annotations

import importlib
import pkgutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dit.cost.analytic import forward_macs, training_flops_per_image, vae_flops
from dit.cost.measured import measure_flops
from dit.cost.meter import CostMeter
from dit.cost.peaks import forget_cpu_peak, peak_for_device
from dit.cost.vae_facts import known_vae_config
from dit.io.config import Section, option
from dit.model.config import describe
from dit.model.dit import DiT
from dit.runtime import DeviceSection, Runtime
from dit.train.data import TrainData
from dit.train.sinks import Sinks, TensorBoard


def _sink_modules() -> dict[str, type]:
    """``--sinks NAME`` for each ``dit/train/sinks_NAME.py`` (its ``SINK``): a new file is a new sink."""
    package = importlib.import_module("dit.train")
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("sinks_"))
    return {name.removeprefix("sinks_"): importlib.import_module(f"dit.train.{name}").SINK for name in names}


SINKS = {"tensorboard": TensorBoard, **_sink_modules()}  # --sinks; console, log.txt and metrics.jsonl always


@dataclass(frozen=True)
class _LedgerOptions(Section):
    """The ledger's own options, ahead of the sinks' (the order of --help and of the record)."""

    log_every: int = option(
        100,
        "steps per log line (the only host syncs); several processes honour a stop signal within as many",
        ge=1,
    )
    mfu_warmup_steps: int = option(3, "first steps kept out of the MFU windows", ge=0)
    price_per_hour: float | None = option(None, "device-hour price for the cost projection", ge=0)
    progress: bool = option(True, "show progress with an ETA on rank 0 (plain lines when not on a terminal)")
    sample_every: int = option(0, "steps per EMA sample grid to the sinks (0: off)", ge=0)
    sinks: tuple[str, ...] = option(("tensorboard",), "where records go besides the console, log.txt and "
                                    "metrics.jsonl; wandb needs dit-ledger[wandb]", choices=tuple(SINKS))  # fmt: skip


@dataclass(frozen=True)
class LedgerSection(*reversed([s.options for s in SINKS.values() if s.options]), _LedgerOptions):
    """What the run reports and how often, then each sink's own options (``Sink.options``)."""


class StepCounters:
    """Loss and non-finite counts (and REPA's alignment loss) kept on the device, read in one sync per log step."""

    def __init__(self, device: torch.device, alignment: bool = False):
        zero = torch.zeros((), dtype=torch.long, device=device)
        self.loss_sum = torch.zeros((), device=device)
        self.align_sum = torch.zeros((), device=device) if alignment else None
        self.loss_count, self.nonfinite_total, self.nonfinite_streak = zero.clone(), zero.clone(), zero.clone()
        self.longest_streak = zero.clone()  # in this window: a streak that ended between two logs still counts

    def add(self, loss: torch.Tensor, bad: torch.Tensor, align: torch.Tensor | None = None) -> None:
        if self.align_sum is not None:
            self.align_sum += torch.where(bad, torch.zeros_like(align), align)
        bad = bad.long()
        self.nonfinite_total += bad
        self.nonfinite_streak = (self.nonfinite_streak + 1) * bad
        self.longest_streak = torch.maximum(self.longest_streak, self.nonfinite_streak)
        self.loss_sum += torch.where(bad.bool(), torch.zeros_like(loss), loss)
        self.loss_count += 1 - bad

    def read(self, runtime: Runtime) -> dict:
        """Window means over all ranks and the non-finite counts; opens a new window."""
        stats = [self.loss_sum, self.loss_count, self.nonfinite_total, self.nonfinite_streak, self.longest_streak]
        stats += [self.align_sum] if self.align_sum is not None else []
        total, count, nonfinite, streak, longest, *align = runtime.all_reduce(torch.stack(stats).float()).tolist()
        for window_sum in (self.loss_sum, self.align_sum, self.loss_count):
            if window_sum is not None:
                window_sum.zero_()
        self.longest_streak.copy_(self.nonfinite_streak)  # a streak still running carries into the next window
        world = runtime.world  # every rank counts the same skipped steps (the skip is all-reduced)
        repa = {"repa_loss": align[0] / count if count else float("nan")} if align else {}  # as the loss
        return {
            **repa,
            "loss": total / count if count else float("nan"),
            "nonfinite_steps": round(nonfinite / world),
            "nonfinite_streak": round(streak / world),
            "longest_nonfinite_streak": round(longest / world),
        }


def device_memory(device: torch.device) -> dict:
    """This window's CUDA peaks (GiB) and the allocator's retries (each a stall: memory is nearly full)."""
    if device.type != "cuda":
        return {"max_memory_gib": None, "max_memory_reserved_gib": None, "alloc_retries": None}
    return {
        "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        "alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0),
    }


class Ledger:
    def __init__(
        self,
        section: LedgerSection,
        device: DeviceSection,
        *,
        model: DiT,
        attention: str,
        data: TrainData,
        runtime: Runtime,
        out: Path,
        record: dict,
        image_size: int,
        total_steps: int,
        images_per_step: int,
        start_step: int = 0,
        repa=None,
        dropped_steps: int = 0,
    ):
        """``images_per_step`` on this rank; ``start_step``: steps before a resume, ``dropped_steps`` of them."""
        self.section, self.device, self.runtime, self.data, self.repa = section, device, runtime, data, repa
        self.total_steps = total_steps
        self.model_cfg, self.attention = model.config, attention
        self.fused_attention = attention not in ("explicit", "math")  # the T x T matrix is recomputed
        self.checkpointed = model.num_checkpointed_blocks
        self.params = sum(p.numel() for p in model.parameters())
        chosen = [SINKS[name] for name in dict.fromkeys(section.sinks)]
        self.sinks = Sinks(section, out, record, chosen, start=start_step, enabled=runtime.is_main)
        mc = self.model_cfg
        self.flops = training_flops_per_image(mc, self.checkpointed, self.fused_attention)
        self.full_flops = training_flops_per_image(mc, self.checkpointed, self.fused_attention, ratio=0)
        measured = measure_flops(mc, batch_size=1, train=True, checkpointed_blocks=self.checkpointed)
        self.measured_flops_per_image = float(measured["train_flops_per_image"])
        vae_config = data.vae_config if data.vae_config is not None else known_vae_config(data.vae_spec)
        self.vae = vae_flops(vae_config, image_size) if vae_config is not None else None
        self.peak = peak_for_device(runtime.device, device.precision, device.peak_tflops)
        vae = self.vae.encode if data.vae is not None and self.vae is not None else 0.0  # encoded on the fly
        aux = repa.flops.per_step_image(repa.cached) if repa is not None else 0.0
        flops = self.flops
        self.meter = CostMeter(flops.model, flops.hardware, mc.tokens, self.peak, runtime.world, vae, aux)
        self.meter.total_images = start_step * images_per_step
        full_steps = start_step - dropped_steps
        self.meter.total_model_flops = images_per_step * (
            dropped_steps * flops.model + full_steps * self.full_flops.model
        )
        self.projected = self.peak_doubted = self.memory_compared = False

    def report(self, memory_estimate: float) -> None:
        """The start-up lines: model, FLOPs per image, VAE, memory (the fit check's estimate per device), peak."""
        precision, mc, s = self.device.precision, self.model_cfg, self.sinks
        # The meta-device count has no fused-attention recompute: compare it with the same analytic count.
        comparable = training_flops_per_image(mc, self.checkpointed, fused_attention=False).hardware
        gap = self.measured_flops_per_image / comparable - 1
        self.memory_estimate = memory_estimate
        fwd = 2 * forward_macs(mc).total
        s.info(
            f"dit-ledger: {describe(mc)}; {self.params:,} parameters; {self.runtime.world} process(es) on {self.runtime.device}"
        )
        s.info(
            f"FLOPs per image (2 per multiply-add): forward {fwd / 1e9:.4g} G, training (3x forward, for MFU) "
            f"{self.flops.model / 1e9:.4g} G, hardware (with {self.checkpointed} recomputed blocks, for HFU) "
            f"{self.flops.hardware / 1e9:.4g} G; measured on the meta device {self.measured_flops_per_image / 1e9:.4g} G "
            f"({gap:+.3%} vs the analytic count of the same ops: backward skips the input gradients)"
        )
        if mc.token_drop:
            s.info(
                f"token drop {mc.token_drop:g} ({mc.token_drop_layout}): the sparse blocks see {mc.kept_tokens()} of "
                f"{mc.tokens} tokens; training {self.flops.model / 1e9:.4g} G per image while dropping, "
                f"{self.full_flops.model / 1e9:.4g} G at full tokens (MFU counts each step's own)"
            )
        s.info(self._vae_line())
        for line in self.repa.describe(self.flops.model, self.data.store_manifest) if self.repa else ():
            s.info(line)
        s.info(
            f"memory estimate per device: {memory_estimate / 2**30:.3g} GiB ({precision}, {self.checkpointed} blocks "
            f"checkpointed, {self.attention} attention)"
        )
        s.info(f"peak for {precision}: {self.peak.describe()}")

    def _vae_line(self) -> str:
        data, vae = self.data, self.vae
        if data.vae_spec is None:
            return "VAE: none (pixel space)"
        if vae is None:
            return f"VAE encode: cost unknown ({data.vae_spec!r} has no AutoencoderKL config on record)"
        if data.vae is not None:
            share = vae.encode / (vae.encode + self.flops.model)
            return (
                f"VAE encode on the fly: {vae.encode / 1e9:.4g} GFLOP per image inside every step ({share:.1%} of "
                "its FLOPs): records give mfu (the DiT alone) and mfu_with_vae (the encoder too)"
            )
        m = data.store_manifest or {}
        views = 2 if m.get("flips_stored") else 1
        total = vae.encode * views * m.get("num_images", 0)
        return (
            f"VAE encode: paid once, at extraction: {vae.encode / 1e9:.4g} GFLOP per image x {views} view(s) x "
            f"{m.get('num_images', 0):,} images = {total / 1e15:.4g} PFLOP ({data.vae_spec}); not in this run's MFU"
        )

    def count(self, local_images: int, data_wait_s: float, dropping: bool = True) -> None:
        """One step's images; ``dropping``: whether it dropped tokens."""
        flops = self.flops if dropping else self.full_flops
        self.meter.step(local_images, data_wait_s=data_wait_s, flops=(flops.model, flops.hardware))

    def start_window(self) -> None:
        """Open a fresh MFU window (after warm-up or a resume)."""
        self.runtime.sync()
        self.meter.reset_clock(time.perf_counter())

    def aside(self, work, *args) -> None:
        """``work(*args)`` out of the MFU window: checkpoints, sample grids and evaluations."""
        self.runtime.sync()
        self.meter.pause()
        try:
            work(*args)
        finally:
            self.runtime.sync()
            self.meter.resume()

    def log(
        self, *, step: int, epoch: int, counters: dict, grad_norm, lr: float, in_warmup: bool, loss_scale=None
    ) -> dict:
        self.runtime.sync()
        window = self.meter.window(time.perf_counter())
        if grad_norm is not None:
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        # the meta-device count of the dropping stage, scaled to the steps' own analytic FLOPs
        measured = window["model_tflops_per_device"] * self.measured_flops_per_image / self.flops.model
        record = {
            "kind": "train",
            "step": step,
            "epoch": epoch,
            "loss": counters["loss"],
            **({"repa_loss": counters["repa_loss"]} if "repa_loss" in counters else {}),  # minus the cosine
            "grad_norm": grad_norm,
            "lr": lr,
            **window,
            "measured_tflops_per_device": measured,
            **device_memory(self.runtime.device),
            "loss_scale": loss_scale,
            "nonfinite_steps": counters["nonfinite_steps"],
            "in_warmup": in_warmup,
        }
        self.sinks.log(record, console_keys=self.sinks.CONSOLE_KEYS + (("repa_loss",) if self.repa else ()))
        if self.runtime.device.type == "cuda":
            if not self.memory_compared:  # the first window on a device: the estimate the start-up's fit check
                self.memory_compared = True  # trusts, checked so far on CPU traces only, vs the allocator
                self.sinks.info(
                    f"memory, first window: {record['max_memory_reserved_gib']:.3g} GiB reserved at most "
                    f"({record['max_memory_gib']:.3g} GiB allocated), estimate {self.memory_estimate / 2**30:.3g} GiB "
                    "(dit.cost.memory, which the start-up's fit check uses)"
                )
            torch.cuda.reset_peak_memory_stats(self.runtime.device)  # the next record's peaks are its window's
        if not self.projected and not in_warmup and window["steps_per_sec"] > 0:
            self._project(step, window)
        if not in_warmup and window["hfu"] > 1 and self.peak.measured_on and not self.peak_doubted:
            self._doubt_peak(window["hfu"])
        return record

    def _doubt_peak(self, hfu: float) -> None:
        """A run above its measured peak means a busy probe: drop the peak from the cache and say so."""
        self.peak_doubted = True
        dropped = forget_cpu_peak(self.peak.precision)
        where = f"removed from {dropped}, so the next run measures again" if dropped else "not kept"
        self.sinks.info(
            f"HFU {hfu:.0%} is above 100%: the measured peak ({self.peak.describe()}) is below what this run "
            f"computes, so it was probed while another job shared the cores; {where}. This run's MFU and HFU "
            "are relative to that low peak."
        )

    def log_eval(self, step: int, scores: dict) -> dict:
        """An evaluation's record: the scores against the training compute so far, and its own cost."""
        record = {"kind": "eval", "step": step, **self.meter.totals(), **scores}
        if self.repa is not None:  # REPA: what its encoder cost before this run (training it, extracting features)
            record.update(self.repa.upstream_record())
        keys = ("step", "fid", "sfid", "inception_score", "precision", "recall", "class_accuracy",
                "total_model_pflops", "eval_seconds")  # fmt: skip
        self.sinks.log(record, console_keys=keys)
        return record

    def _project(self, step: int, window: dict) -> None:
        remaining = self.total_steps - step
        hours = remaining / window["steps_per_sec"] / 3600
        world = self.runtime.world
        msg = (
            f"projection at measured MFU {window['mfu']:.1%}: {remaining:,} steps left, {hours:.2f} h wall-clock, "
            f"{hours * world:.2f} device-hours"
        )
        if price := self.section.price_per_hour:
            msg += f", {hours * world * price:,.2f} at {price}/device-hour"
        self.sinks.info(msg)
        self.projected = True

    def close(self) -> None:
        self.sinks.close()
