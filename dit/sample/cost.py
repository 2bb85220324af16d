"""What sampling cost: FLOPs from the cost package, time from the clock, DiT and VAE decode apart.

The DiT's FLOPs are divided by the time the DiT ran, and the decode's by the time the decode ran, so
each MFU has its numerator and its timed region covering the same work; the line prints enough digits to
recompute both from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dit.cost.analytic import sampling_flops_per_image, vae_flops
from dit.cost.peaks import Peak, peak_for_device
from dit.errors import UserError
from dit.sample.generate import SamplingModel


@dataclass
class SamplingCost:
    model_flops_per_image: float  # the DiT over all steps, doubled where guidance doubles the batch
    vae_flops_per_image: float  # one VAE decode; 0 for pixel-space models
    nfe: float  # network evaluations per image, as run (dopri5: the mean over batches) (a guided evaluation doubles the batch, not the count)
    sampler: str
    guided: bool
    images: int
    dit_s: float  # wall time of the denoising loop
    decode_s: float  # wall time of the VAE decode (0 for pixel space)
    peak: Peak | None
    peak_note: str = ""  # why there is no peak, when there is none

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

        passes = 2 if self.guided else 1
        doubling = ", guidance doubles the batch" if self.guided else ""
        line = (
            f"cost: DiT {self.model_flops_per_image / 1e12:.6g} TFLOP/image ({self.sampler}: {self.nfe:g} network evaluations (NFE) x "
            f"{passes} pass{'es' if passes > 1 else ''}{doubling}) for {self.images} images in {self.dit_s:.6g} s, "
            f"MFU {pct(self.mfu)}"
        )
        if self.vae_flops_per_image:
            line += (
                f"; with the VAE decode ({self.vae_flops_per_image / 1e12:.6g} TFLOP/image, {self.decode_s:.6g} s): "
                f"{self.flops_per_image / 1e12:.6g} TFLOP/image in {self.wall_s:.6g} s, MFU {pct(self.mfu_with_vae)}"
            )
        line += f"; {self.images_per_s:.4g} images/s"
        if self.peak is not None:
            line += f"; peak {self.peak.describe()}"
        else:
            line += f"; no peak ({self.peak_note})"
        return line


def flops_per_image(sm: SamplingModel, nfe: float, guidance_scale: float) -> tuple[float, float]:
    """(DiT FLOPs over ``nfe`` evaluations incl. the guidance doubling, VAE decode FLOPs) per image."""
    decode_flops = float(vae_flops(dict(sm.vae.config), sm.image_size).decode) if sm.vae is not None else 0.0
    counted = sampling_flops_per_image(sm.config, nfe, guidance_scale, vae_decode_flops=decode_flops)
    return counted.model, counted.vae_decode


def device_peak(device: torch.device, precision: str, peak_tflops: float | None = None) -> tuple[Peak | None, str]:
    """(peak, why none) for the device the sampler runs on, looked up before sampling: a device without a
    published rate gets MFU "n/a" and a reason, instead of an error after hours of sampling."""
    try:
        return peak_for_device(device, precision, peak_tflops), ""
    except UserError as e:
        if peak_tflops is not None:  # a bad --peak-tflops is the user's to fix
            raise
        return None, str(e)


def measure_cost(
    sm: SamplingModel,
    sampler,
    guidance_scale: float,
    images: int,
    dit_s: float,
    decode_s: float,
    peak: tuple[Peak | None, str],
) -> SamplingCost:
    """The cost of ``images`` made by ``sampler`` (after its run: its evaluation count is the one it made)."""
    model_flops, decode_flops = flops_per_image(sm, sampler.mean_nfe, guidance_scale)
    return SamplingCost(
        model_flops, decode_flops, sampler.mean_nfe, sampler.describe(), guidance_scale > 1, images, dit_s, decode_s,
        peak[0], peak[1],
    )  # fmt: skip
