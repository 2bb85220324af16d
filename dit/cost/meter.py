"""Throughput, MFU and HFU per logging window from host-side counters only: ``step`` every step (no sync),
``window`` after the log step's one sync; saves, sampling and warm-up are kept out of the window."""

from __future__ import annotations

import time

from dit.cost.peaks import Peak


class CostMeter:
    """Per-device rates since the last ``window()``: ``mfu`` (the DiT's ``.model`` FLOPs), ``hfu`` (``.hardware``),
    ``mfu_with_vae`` (an on-the-fly encode) and ``mfu_with_aux`` (REPA's networks); equal local batches assumed."""

    def __init__(
        self,
        model_flops_per_image: float,
        hardware_flops_per_image: float,
        tokens_per_image: int,
        peak: Peak,
        world_size: int = 1,
        vae_flops_per_image: float = 0.0,
        aux_flops_per_image: float = 0.0,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.model_flops_per_image = float(model_flops_per_image)
        self.hardware_flops_per_image = float(hardware_flops_per_image)
        self.vae_flops_per_image = float(vae_flops_per_image)
        self.aux_flops_per_image = float(aux_flops_per_image)
        self.tokens_per_image = tokens_per_image
        self.peak = peak
        self.world_size = world_size
        self.total_images = 0  # this rank, since construction: for the run's FLOP ledger
        self.total_model_flops = 0.0  # this rank's model FLOPs, likewise
        self._paused_at: float | None = None
        self.reset_clock()

    def reset_clock(self, now: float | None = None) -> None:
        """Start a fresh window now, dropping what was counted (after warm-up, compile, a resume)."""
        self._start = time.perf_counter() if now is None else now
        self._paused_s = self._model_flops = self._hardware_flops = self._data_wait_s = 0.0
        self._images = self._steps = 0
        if self._paused_at is not None:
            self._paused_at = self._start

    def step(self, local_images: int, data_wait_s: float = 0.0, flops: tuple[float, float] | None = None) -> None:
        """Count one step of ``local_images`` images; ``flops``: its (model, hardware) FLOPs per image."""
        model, hardware = flops or (self.model_flops_per_image, self.hardware_flops_per_image)
        self._model_flops += local_images * model
        self._hardware_flops += local_images * hardware
        self.total_model_flops += local_images * model
        self._images += local_images
        self._steps += 1
        self._data_wait_s += data_wait_s
        self.total_images += local_images

    def pause(self, now: float | None = None) -> None:
        """Stop the clock (checkpoint save, sampling, evaluation) until ``resume``."""
        if self._paused_at is None:
            self._paused_at = time.perf_counter() if now is None else now

    def resume(self, now: float | None = None) -> None:
        if self._paused_at is not None:
            self._paused_s += (time.perf_counter() if now is None else now) - self._paused_at
            self._paused_at = None

    def window(self, now: float | None = None) -> dict:
        """Rates since the last window (call right after the log step's device sync), then a new window."""
        now = time.perf_counter() if now is None else now
        paused = self._paused_s + (now - self._paused_at if self._paused_at is not None else 0.0)
        elapsed = max(now - self._start - paused, 1e-12)
        images_per_sec = self._images / elapsed
        model_flops, hardware_flops = self._model_flops / elapsed, self._hardware_flops / elapsed
        stats = {
            "steps_per_sec": self._steps / elapsed,
            "images_per_sec": images_per_sec * self.world_size,
            "images_per_sec_per_device": images_per_sec,
            "tokens_per_sec_per_device": images_per_sec * self.tokens_per_image,
            "model_tflops_per_device": model_flops / 1e12,
            "hardware_tflops_per_device": hardware_flops / 1e12,
            "peak_tflops": self.peak.flops / 1e12,
            "peak_source": self.peak.source,
            "peak_measured_on": self.peak.measured_on or None,
            "mfu": model_flops / self.peak.flops,
            "mfu_with_vae": (model_flops + images_per_sec * self.vae_flops_per_image) / self.peak.flops,
            "vae_tflops_per_image": self.vae_flops_per_image / 1e12,
            "mfu_with_aux": (model_flops + images_per_sec * self.aux_flops_per_image) / self.peak.flops,
            "aux_tflops_per_image": self.aux_flops_per_image / 1e12,
            "hfu": hardware_flops / self.peak.flops,
            # host time in next(loader): the device may still be busy with the step before (not device idle)
            "host_data_wait_frac": self._data_wait_s / elapsed,
            "window_s": elapsed,
            **self.totals(),
        }
        self.reset_clock(now)
        return stats

    def totals(self) -> dict:
        """The run's model and auxiliary PFLOPs so far, over every device."""
        return {
            "total_model_pflops": self.total_model_flops * self.world_size / 1e15,
            "total_aux_pflops": self.total_images * self.world_size * self.aux_flops_per_image / 1e15,
        }
