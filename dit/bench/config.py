"""The benchmark modes' settings: one dataclass each, flags named as in train.py and sample.py."""

from __future__ import annotations

from dataclasses import dataclass

from dit.config import option
from dit.models import ATTENTION_BACKENDS
from dit.runtime import PRECISIONS
from dit.sample.config import GUIDANCE_HELP
from dit.train.config import ACTIVATION_CHECKPOINTING_HELP

JSON_HELP = "write the rows (and the matmul peaks) to this file"


@dataclass
class TrainBench:
    """Training steps through ``Trainer.train_step`` on synthetic latents, precisions taking turns."""

    model: list[str] = option(["DiT-S/2"], "registry names")
    global_batch_size: list[int] = option([8], "images per step (one process)")
    precision: list[str] = option(["fp32"], "precisions, timed in turns step by step", choices=PRECISIONS)
    image_size: int = option(256, "pixels (latents are image / 8)")
    activation_checkpointing: list[str] = option(["none"], ACTIVATION_CHECKPOINTING_HELP)
    compile: list[str] = option(["off"], "torch.compile each block", choices=("off", "on"))
    attention: list[str] = option(["auto"], "attention kernels", choices=ATTENTION_BACKENDS)
    timed_steps: int = option(10, "steps timed per configuration")
    untimed_steps: int = option(3, "warm-up steps before timing")
    peak_probe: float = option(
        0.25,
        "seconds of fp32 and bf16 matmul-peak probes between step rounds (0: off); the fp32 fraction divides "
        "by their median",
    )
    calibration: str | None = option(None, "write the best row as a dit-cost calibration JSON")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    peak_tflops: float | None = option(None, "override the peak used for MFU")
    json: str | None = option(None, JSON_HELP)


@dataclass
class SampleBench:
    """The guided DDPM sampler on random weights (speed does not depend on them)."""

    model: list[str] = option(["DiT-S/2"], "registry names")
    per_proc_batch_size: list[int] = option([8], "images per batch")
    precision: list[str] = option(["fp32"], "precisions", choices=PRECISIONS)
    image_size: int = option(256, "pixels (latents are image / 8)")
    attention: list[str] = option(["auto"], "attention kernels", choices=ATTENTION_BACKENDS)
    num_sampling_steps: int = option(10, "denoising steps")
    guidance_scale: float = option(4.0, GUIDANCE_HELP, aliases=("--cfg-scale",))
    repeats: int = option(3, "timed runs after one warm-up run")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    peak_tflops: float | None = option(None, "override the peak used for MFU")
    json: str | None = option(None, JSON_HELP)


@dataclass
class AccountingBench:
    """What cost accounting adds to a step: the meter's per-step counters and one log per window."""

    model: list[str] = option(["DiT-S/2"], "registry names")
    global_batch_size: list[int] = option([8], "images per step")
    precision: list[str] = option(["fp32"], "precisions", choices=PRECISIONS)
    image_size: int = option(256, "pixels (latents are image / 8)")
    log_every: int = option(100, "steps per log, over which one log's cost is spread")
    json: str | None = option(None, JSON_HELP)


@dataclass
class ReaderBench:
    """Latent-store samples/s in one process (default: a synthetic 4x32x32 fp16 store with flips)."""

    store: str | None = option(None, "an existing store (default: a synthetic one in a temp folder)")
    images: int = option(10_000, "images in the synthetic store")
    global_batch_size: int = option(256, "images per loader batch")
    seconds: float = option(3.0, "seconds per timed run")
    repeats: int = option(5, "timed runs")
    threads: int = option(1, "torch threads (1: one data process's share)")
    json: str | None = option(None, JSON_HELP)


@dataclass
class LossBench:
    """fp32 and bf16 training curves of the quick-start model with DiT's objective, against a second seed."""

    max_steps: int = option(400, "steps per run")
    log_every: int = option(10, "steps per logged loss")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    plot: str | None = option(None, "write the curves to this PNG")
    json: str | None = option(None, JSON_HELP)


@dataclass
class ProfileBench:
    """torch.profiler's op table of one training step."""

    model: str = option("DiT-S/2", "registry name")
    precision: str = option("fp32", "precision", choices=PRECISIONS)
    global_batch_size: int = option(8, "images per step")
    image_size: int = option(256, "pixels (latents are image / 8)")
    rows: int = option(25, "table rows")


@dataclass
class AttentionBench:
    """One block's attention forward and backward per kernel, at the model's shapes."""

    model: str = option("DiT-S/2", "registry name")
    precision: str = option("fp32", "precision", choices=PRECISIONS)
    global_batch_size: int = option(8, "images per step")
    image_size: int = option(256, "pixels (latents are image / 8)")
    attention: list[str] = option(["flash", "math", "explicit"], "kernels", choices=ATTENTION_BACKENDS)
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    json: str | None = option(None, JSON_HELP)


@dataclass
class RepeatBench:
    """The quick start's training run repeated in fresh processes: does MFU agree from run to run?"""

    runs: int = option(3, "training runs, one process each")
    max_steps: int = option(300, "steps per run")
    peak: str = option(
        "fresh",
        "fresh: every run measures the CPU peak anew; cached: the runs share one measurement",
        choices=("fresh", "cached"),
    )
    eval_every: int = option(0, "also evaluate every N steps (100 digit samples): the MFU must not change")
    json: str | None = option(None, JSON_HELP)


@dataclass
class PrecisionBench:
    """bf16 against fp32 in sample quality: the quick-start recipe per precision and seed, digit FID at equal steps."""

    max_steps: int = option(1200, "steps per run (the quick start's default)")
    precision: list[str] = option(["fp32", "bf16"], "precisions", choices=PRECISIONS)
    seeds: list[int] = option([0, 1], "training seeds per precision")
    eval_samples: int = option(500, "EMA samples scored per run")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    json: str | None = option(None, JSON_HELP)
