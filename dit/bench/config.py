"""The benchmark modes' settings: one dataclass each, flags named as in train.py and sample.py."""

from __future__ import annotations

from dataclasses import dataclass

from dit.io.config import Section, option
from dit.model.config import ACTIVATION_CHECKPOINTING_HELP
from dit.model.layers import ATTENTION_BACKENDS
from dit.objectives.sampling_section import GUIDANCE_HELP
from dit.runtime import PRECISIONS

OUT_HELP = "write the rows (and the matmul peaks) to this JSON file"


@dataclass(frozen=True)
class TrainBench(Section):
    """Training steps through ``Trainer.train_step`` on synthetic latents, precisions taking turns."""

    model: tuple[str, ...] = option(
        ["DiT-S/2"], "registry names, or digits: the digits recipe's model (the quick start's: depth 6, width "
        "128, patch 4) and objective on 28 px, 1-channel images (--image-size does not apply)",
    )  # fmt: skip
    global_batch_size: tuple[int, ...] = option([8], "images per step (one process)")
    precision: tuple[str, ...] = option(["fp32"], "precisions, timed in turns step by step", choices=PRECISIONS)
    image_size: int = option(256, "pixels (latents are image / 8)")
    activation_checkpointing: tuple[str, ...] = option(["none"], ACTIVATION_CHECKPOINTING_HELP)
    compile: tuple[str, ...] = option(["off"], "torch.compile each block", choices=("off", "on"))
    attention: tuple[str, ...] = option(["auto"], "attention kernels", choices=ATTENTION_BACKENDS)
    token_drop: tuple[float, ...] = option(
        [0.0], "token-drop ratios (train.py's --token-drop, sprint layout), timed in turns with the precisions",
        ge=0, lt=1,
    )  # fmt: skip
    timed_steps: int = option(10, "steps timed per configuration")
    untimed_steps: int = option(3, "warm-up steps before timing")
    peak_probe: float = option(
        0.25,
        "seconds of fp32 and bf16 matmul-peak probes between step rounds (0: off, and 0.25 s instead of 2 s "
        "for the ceilings measured before and after the run); the fp32 fraction divides by their median",
    )
    calibration: str | None = option(None, "write the best row as a dit-cost calibration JSON")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    peak_tflops: float | None = option(None, "override the peak used for MFU", gt=0)
    memory_gib: float | None = option(
        None,
        "device memory for the fit check: a configuration whose dit-cost memory estimate exceeds the usable part "
        "(10%, at least 2 GiB, kept free) is skipped, its reason in its row (default: the CUDA device's, no "
        "check on CPU; 0: no check)",
        ge=0,
    )
    out: str | None = option(None, OUT_HELP + "; rewritten as each row finishes")


@dataclass(frozen=True)
class SampleBench(Section):
    """The guided DDPM sampler on random weights (speed does not depend on them)."""

    model: tuple[str, ...] = option(["DiT-S/2"], "registry names")
    batch_size: tuple[int, ...] = option([8], "images per batch", aliases=("--per-proc-batch-size",))
    precision: tuple[str, ...] = option(["fp32"], "precisions", choices=PRECISIONS)
    image_size: int = option(256, "pixels (latents are image / 8)")
    attention: tuple[str, ...] = option(["auto"], "attention kernels", choices=ATTENTION_BACKENDS)
    num_sampling_steps: int = option(10, "denoising steps")
    guidance_scale: float = option(4.0, GUIDANCE_HELP, aliases=("--cfg-scale",), ge=1)
    repeats: int = option(3, "timed runs after one warm-up run")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    peak_tflops: float | None = option(None, "override the peak used for MFU", gt=0)
    out: str | None = option(None, OUT_HELP)


@dataclass(frozen=True)
class AccountingBench(Section):
    """What cost accounting adds to a step: the meter's per-step counters and one log per window."""

    model: tuple[str, ...] = option(["DiT-S/2"], "registry names")
    global_batch_size: tuple[int, ...] = option([8], "images per step")
    precision: tuple[str, ...] = option(["fp32"], "precisions", choices=PRECISIONS)
    image_size: int = option(256, "pixels (latents are image / 8)")
    log_every: int = option(100, "steps per log, over which one log's cost is spread")
    out: str | None = option(None, OUT_HELP)


@dataclass(frozen=True)
class ReaderBench(Section):
    """Latent-store samples/s in one process (default: a synthetic 4x32x32 fp16 store with flips)."""

    store: str | None = option(None, "an existing store (default: a synthetic one in a temp folder)")
    num_images: int = option(10_000, "images in the synthetic store", ge=1, aliases=("--images",))
    global_batch_size: int = option(256, "images per loader batch")
    seconds: float = option(3.0, "seconds per timed run")
    repeats: int = option(5, "timed runs")
    threads: int = option(1, "torch threads (1: one data process's share)")
    out: str | None = option(None, OUT_HELP)


@dataclass(frozen=True)
class LossBench(Section):
    """fp32 and bf16 training curves of the quick-start model with DiT's objective, against a second seed."""

    max_steps: int = option(400, "steps per run")
    log_every: int = option(10, "steps per logged loss")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    plot: str | None = option(None, "write the curves to this PNG")
    out: str | None = option(None, OUT_HELP)


@dataclass(frozen=True)
class ProfileBench(Section):
    """torch.profiler's op table of one training step."""

    model: str = option("DiT-S/2", "registry name")
    precision: str = option("fp32", "precision", choices=PRECISIONS)
    global_batch_size: int = option(8, "images per step")
    image_size: int = option(256, "pixels (latents are image / 8)")
    rows: int = option(25, "table rows")


@dataclass(frozen=True)
class AttentionBench(Section):
    """One block's attention forward and backward per kernel, at the model's shapes."""

    model: str = option("DiT-S/2", "registry name")
    precision: str = option("fp32", "precision", choices=PRECISIONS)
    global_batch_size: int = option(8, "images per step")
    image_size: int = option(256, "pixels (latents are image / 8)")
    attention: tuple[str, ...] = option(["flash", "math", "explicit"], "kernels", choices=ATTENTION_BACKENDS)
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    out: str | None = option(None, OUT_HELP)


@dataclass(frozen=True)
class RepeatBench(Section):
    """The quick start's training run repeated in fresh processes: does MFU agree from run to run?"""

    repeats: int = option(3, "training runs, one process each", ge=1, aliases=("--runs",))
    max_steps: int = option(300, "steps per run")
    peak: str = option(
        "fresh",
        "fresh: every run measures the CPU peak anew; cached: the runs share one measurement",
        choices=("fresh", "cached"),
    )
    eval_every: int = option(0, "also evaluate every N steps (100 digit samples): the MFU must not change")
    out: str | None = option(None, OUT_HELP)


@dataclass(frozen=True)
class PrecisionBench(Section):
    """bf16 against fp32 in sample quality: the quick-start recipe per precision and seed, digit FID at equal steps."""

    max_steps: int = option(1200, "steps per run (the quick start's default)")
    precision: tuple[str, ...] = option(["fp32", "bf16"], "precisions", choices=PRECISIONS)
    seeds: tuple[int, ...] = option([0, 1], "training seeds per precision")
    eval_samples: int = option(500, "EMA samples scored per run")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    out: str | None = option(None, OUT_HELP)
