"""Benchmarks below the training step: the sampler, attention kernels, matmul ceilings, the latent-store reader."""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.data import DataLoader

from dit.bench.steps import _fresh_device_memory, spread
from dit.cost.analytic import sampling_flops_per_image
from dit.cost.peaks import device_name, peak_for_device
from dit.model.config import model_config
from dit.model.dit import DiT_models
from dit.model.layers import Attention, attention_context, attention_kernel
from dit.runtime import Runtime
from dit.sample.cost import timed


def bench_sample(
    model: str = "DiT-S/2",
    image_size: int = 256,
    precision: str = "fp32",
    batch_size: int = 8,
    num_sampling_steps: int = 10,
    guidance_scale: float = 4.0,
    repeats: int = 3,
    device: str | None = None,
    peak_tflops: float | None = None,
    attention: str = "auto",
) -> dict:
    """Images/s and MFU of the guided DDPM sampler on random weights (speed does not depend on them)."""
    from dit.sample.generate import Guidance, Sampler, SamplingModel, sample_latents

    with Runtime(device, precision) as runtime:
        dev = runtime.device
        net = DiT_models[model](input_size=image_size // 8).to(dev).eval().set_attention(attention)
        sm = SamplingModel(net, "random", image_size, None, None)
        sampler = Sampler(sm, num_sampling_steps, "ddpm", guidance=Guidance(guidance_scale))
        labels, seeds = [i % 1000 for i in range(batch_size)], list(range(batch_size))
        _fresh_device_memory(dev)
        run = (sm, sampler, labels, seeds)
        times = [timed(runtime, sample_latents, *run, precision=runtime.precision)[1] for _ in range(repeats + 1)]
        del times[0]  # the first run warms up
        peak = peak_for_device(dev, precision, peak_tflops)
        memory = {}
        if dev.type == "cuda":
            memory = {
                "max_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
                "max_memory_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30,
            }
    timing = spread(times)
    flops = sampling_flops_per_image(net.config, num_sampling_steps, guidance_scale).model
    rate = batch_size / timing["median_s"]
    kernel = attention_kernel(attention, dev.type, runtime.precision.compute_dtype)
    return {
        "mode": "sample",
        "model": model,
        "image_size": image_size,
        "precision": precision,
        "batch": batch_size,
        "num_sampling_steps": num_sampling_steps,
        "guidance_scale": guidance_scale,
        "attention": kernel,
        "device": device_name(dev),
        **timing,
        "images_per_sec": rate,
        "model_tflops": rate * flops / 1e12,
        "peak_tflops": peak.flops / 1e12,
        "peak_source": peak.source,
        "mfu": rate * flops / peak.flops,
        **memory,
    }


def bench_attention(
    model: str = "DiT-S/2",
    precision: str = "fp32",
    batch_size: int = 8,
    image_size: int = 256,
    backends=("flash", "math", "explicit"),
    repeats: int = 9,
    device: str | None = None,
) -> list[dict]:
    """Forward + backward of one block's attention per kernel, at the model's shapes (median of ``repeats``)."""
    with Runtime(device, precision) as runtime:
        dev, dtype = runtime.device, runtime.precision.compute_dtype
        mc = model_config(model, input_size=image_size // 8)
        attn = Attention(mc).to(dev, dtype)
        x = torch.randn(batch_size, mc.tokens, mc.hidden_size, device=dev, dtype=dtype, requires_grad=True)
        out = []
        for backend in backends:
            attn.backend = backend
            with attention_context(backend):  # as DiT.forward pins it: around the module
                times = [timed(runtime, lambda: attn(x).sum().backward())[1] for _ in range(repeats + 1)][1:]
            kernel = attention_kernel(backend, dev.type, dtype)
            row = {
                "mode": "attention",
                "model": model,
                "precision": precision,
                "batch": batch_size,
                "attention": kernel,
                "device": device_name(dev),
                **spread(times),
            }
            out.append(row)
    return out


def synthetic_store(folder: str, images: int) -> str:
    """An ImageNet-like store: 4x32x32 fp16 moments with flips, 1000 classes."""
    from dit.data.store import write_moments_store

    g = torch.Generator().manual_seed(0)
    moments = torch.randn(images, 2, 2, 4, 32, 32, generator=g).half()
    moments[:, :, 1].abs_()
    write_moments_store(folder, moments, torch.randint(0, 1000, (images,), generator=g), 1000)
    return folder


def bench_reader(store: str, batch_size: int = 256, seconds: float = 3.0, repeats: int = 5) -> dict:
    """Latent-store samples/s per process through a DataLoader (batched ``__getitems__``), from the page cache."""
    from dit.data.reader import LatentStoreDataset

    ds = LatentStoreDataset(store)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=0)

    def rate(duration):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            for x, _ in loader:
                count += len(x)
                if time.perf_counter() - start >= duration:
                    break
        return count / (time.perf_counter() - start)

    rate(1.0)  # page cache and allocator warm-up
    rates = sorted(rate(seconds) for _ in range(repeats))
    return {
        "mode": "reader",
        "store": store,
        "items": len(ds),
        "latent_shape": list(ds.latent_shape),
        "storage_dtype": ds.manifest["storage_dtype"],
        "batch": batch_size,
        "best_samples_per_sec": rates[-1],
        "median_samples_per_sec": statistics.median(rates),
        "threads": torch.get_num_threads(),
    }
