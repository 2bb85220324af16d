"""What sampling cost: FLOPs from the cost package, time from the clock, DiT and VAE decode apart, each MFU
dividing its own FLOPs by its own timed region."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dit.cost.analytic import sampling_flops_per_image, vae_flops
from dit.cost.peaks import Peak, peak_for_device
from dit.io.errors import UserError
from dit.model.config import describe
from dit.sample.generate import Guidance, SamplingModel


@dataclass
class SamplingCost:
    model_flops_per_image: float  # the DiT over all steps, doubled where guidance doubles the batch
    vae_flops_per_image: float  # one VAE decode; 0 for pixel-space models
    guided_nfe: float  # network evaluations per image run guided (two passes each), as run (dopri5: the mean)
    unguided_nfe: float  # ... and run unguided (one pass: guidance off, or outside --guidance-interval)
    sampler: str
    images: int
    dit_s: float  # wall time of the denoising loop
    decode_s: float  # wall time of the VAE decode (0 for pixel space)
    peak: Peak | None
    peak_note: str = ""  # why there is no peak, when there is none
    path_drop: bool = False  # the guided evaluations' unconditional pass skips the sparse blocks
    guide: str = ""  # autoguidance: the guide model, whose pass replaces the unconditional one

    @property
    def nfe(self) -> float:
        return self.guided_nfe + self.unguided_nfe

    @property
    def guided(self) -> bool:
        return self.guided_nfe > 0

    @property
    def flops_per_image(self) -> float:
        return self.model_flops_per_image + self.vae_flops_per_image

    @property
    def wall_s(self) -> float:
        return self.dit_s + self.decode_s

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall_s if self.wall_s > 0 else float("nan")

    def _mfu(self, flops_per_image: float, seconds: float) -> float | None:
        if self.peak is None or seconds <= 0:
            return None
        return flops_per_image * self.images / seconds / self.peak.flops

    @property
    def mfu(self) -> float | None:
        """The DiT's FLOP/s over the device peak, timed over the denoising loop alone."""
        return self._mfu(self.model_flops_per_image, self.dit_s)

    @property
    def mfu_with_vae(self) -> float | None:
        """DiT and VAE decode FLOPs over the whole time: what the device delivered for finished images."""
        return self._mfu(self.flops_per_image, self.wall_s)

    def summary(self) -> str:
        def pct(x):
            return "n/a" if x is None else f"{100 * x:.4g}%"

        doubling = ", guidance doubles the batch" if self.guided else ""
        if self.guided and self.path_drop:
            doubling = ", the unconditional pass without the sparse blocks (path-drop guidance)"
        if self.guided and self.guide:
            doubling = f", the second pass the guide's, {self.guide} (autoguidance)"
        line = (
            f"cost: DiT {self.model_flops_per_image / 1e12:.6g} TFLOP/image ({self.sampler}: {self.nfe:g} network "
            f"evaluations (NFE): {self.guided_nfe:g} guided x 2 passes{doubling} + {self.unguided_nfe:g} unguided x "
            f"1 pass) for {self.images} images in {self.dit_s:.6g} s, MFU {pct(self.mfu)}"
        )
        if self.vae_flops_per_image:
            line += (
                f"; with the VAE decode ({self.vae_flops_per_image / 1e12:.6g} TFLOP/image, {self.decode_s:.6g} s): "
                f"{self.flops_per_image / 1e12:.6g} TFLOP/image in {self.wall_s:.6g} s, MFU {pct(self.mfu_with_vae)}"
            )
        peak = f"peak {self.peak.describe()}" if self.peak is not None else f"no peak ({self.peak_note})"
        return f"{line}; {self.images_per_s:.4g} images/s; {peak}"


def flops_per_image(
    sm: SamplingModel, guided_nfe: float, unguided_nfe: float, guidance: Guidance
) -> tuple[float, float]:
    """(DiT FLOPs of the evaluations, two passes per guided one; VAE decode FLOPs) per image."""
    decode_flops = float(vae_flops(dict(sm.vae.config), sm.image_size).decode) if sm.vae is not None else 0.0
    scale = 2.0 if guided_nfe else 1.0  # any scale above 1 doubles a guided evaluation
    guide = guidance.guide.config if guidance.guide is not None else None
    counted = sampling_flops_per_image(
        sm.config, guided_nfe + unguided_nfe, scale, vae_decode_flops=decode_flops, unguided_nfe=unguided_nfe,
        path_drop=guidance.path_drop, guide=guide,
    )  # fmt: skip
    return counted.model, counted.vae_decode


def timed(runtime, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the seconds it took, the device synced before and after (its queued work
    counted)."""
    runtime.sync()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    runtime.sync()
    return out, time.perf_counter() - start


def device_peak(device: torch.device, precision: str, peak_tflops: float | None = None) -> tuple[Peak | None, str]:
    """(peak, why none) for the sampler's device, looked up before sampling: no published rate is MFU "n/a"."""
    try:
        return peak_for_device(device, precision, peak_tflops), ""
    except UserError as e:
        if peak_tflops is not None:  # a bad --peak-tflops is the user's to fix
            raise
        return None, str(e)


def measure_cost(
    sm: SamplingModel, sampler, images: int, dit_s: float, decode_s: float, peak: tuple[Peak | None, str]
) -> SamplingCost:
    """The cost of ``images`` made by ``sampler`` (after its run: its evaluation counts are the ones it made)."""
    guided, unguided = sampler.mean_guided_nfe, sampler.mean_unguided_nfe
    g = sampler.guidance
    model_flops, decode_flops = flops_per_image(sm, guided, unguided, g)
    guide = "" if g.guide is None else describe(g.guide.config)
    return SamplingCost(
        model_flops, decode_flops, guided, unguided, sampler.describe(), images, dit_s, decode_s, peak[0], peak[1],
        g.path_drop, guide,
    )  # fmt: skip
