"""sample.py's work: one image per class label from a checkpoint, a PNG grid, and what it cost."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torchvision.utils import save_image

from dit.io.atomic import atomic_write
from dit.runtime import Runtime
from dit.sample.config import SampleConfig
from dit.sample.cost import SamplingCost, device_peak, measure_cost, timed
from dit.sample.generate import Sampler, check_labels, default_class_labels, noise_seed, sample_latents, to_images
from dit.sample.guide import load_guide
from dit.sample.loading import load_weights


@dataclass
class SampleReport:
    path: Path
    labels: list[int]
    weights: str
    cost: SamplingCost


def run_sample(c: SampleConfig, runtime: Runtime) -> SampleReport:
    """Sample ``class_labels`` (one image each, image i seeded by (seed, i)) and write a PNG grid."""
    device, g = runtime.device, c.grid
    sm = load_weights(c.weights, device, sd_decoder="mse")  # the official sample.py decodes with mse
    labels = g.class_labels if g.class_labels is not None else default_class_labels(sm.config.num_classes)
    labels = check_labels(labels, sm.config.num_classes)
    sampler = Sampler.from_options(sm, c.sampling, load_guide(c.guide, sm, device))
    seeds = [noise_seed(g.seed, i) for i in range(len(labels))]
    peak = device_peak(device, c.runtime.precision, c.runtime.peak_tflops)
    samples, dit_s = timed(
        runtime, sample_latents, sm, sampler, labels, seeds, precision=runtime.precision, progress=g.progress
    )
    images, decode_s = timed(runtime, to_images, sm, samples)
    out = atomic_write(
        g.out, lambda f: save_image(images, f, "png", nrow=g.nrow, normalize=True, value_range=(-1, 1))
    )
    cost = measure_cost(sm, sampler, len(labels), dit_s, decode_s, peak)
    return SampleReport(out, labels, sm.weights, cost)
