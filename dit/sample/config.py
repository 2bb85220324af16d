"""The sampling faces' configuration: sample.py (a grid) and scripts/sample_ddp.py (an FID set) compose the
same weights, sampling and device sections, and one section of their own each."""

from __future__ import annotations

from dataclasses import dataclass

from dit.io.config import Section, option
from dit.io.face import Face
from dit.objectives.sampling_section import FidSamplingSection, SamplingSection
from dit.runtime import DeviceSection
from dit.sample.guide import GUIDE_INPUTS, GUIDE_PREFIX, GuideSection
from dit.sample.labels import LABEL_MODES
from dit.sample.loading import WeightsSection

_PRECISION = DeviceSection.__dataclass_fields__["precision"].metadata
WEIGHTS_INPUTS = {"ckpt": "file", "vae": "file"}  # what WeightsSection's faces read
SAMPLING_INPUTS = {**WEIGHTS_INPUTS, **GUIDE_INPUTS}


@dataclass(frozen=True)
class SamplingDeviceSection(DeviceSection):
    """The device section with sampling's default precision, tf32: the official scripts' (``--tf32/--no-tf32``)."""

    precision: str = option("tf32", _PRECISION["help"], choices=_PRECISION["choices"])
    tf32: bool | None = option(None, "the official scripts' switch: --tf32 is --precision tf32, --no-tf32 is fp32")

    def __post_init__(self):
        if self.tf32 is not None:  # one precision setting: the official flag only chooses between two of them
            object.__setattr__(self, "precision", "tf32" if self.tf32 else "fp32")
        super().__post_init__()


@dataclass(frozen=True)
class GridSection(Section):
    """sample.py's own: which images, and the PNG grid they go to."""

    class_labels: tuple[int, ...] | None = option(None, "one image per label (default: the official eight)")
    seed: int = option(0, "image i uses the noise of (seed, i)", ge=0, aliases=("--global-seed",))
    out: str = option("sample.png", "PNG grid to write")
    nrow: int = option(4, "images per grid row", ge=1)
    progress: bool = option(True, "show the denoising progress (plain lines when not on a terminal)")


@dataclass(frozen=True)
class FidSetSection(Section):
    """sample_ddp.py's own: the set's size, batches, seed and folder."""

    sample_dir: str = option("samples", "where the set's folder and .npz go (the official scripts' name)")
    batch_size: int = option(32, "images per batch on each process", ge=1, aliases=("--per-proc-batch-size",))
    num_fid_samples: int = option(50_000, "images in the set", ge=1)
    seed: int = option(0, "image i's label and noise are keyed by (seed, i)", ge=0, aliases=("--global-seed",))
    progress: bool = option(True, "show the progress on rank 0 (plain lines when not on a terminal)")
    labels: str | None = option(
        None, "class labels: balanced (N/C images per class) or random (DiT's); default: a resumed set's own, "
        "balanced for a new set", choices=LABEL_MODES,
    )  # fmt: skip


@dataclass(frozen=True)
class SampleConfig:
    weights: WeightsSection
    sampling: SamplingSection
    runtime: SamplingDeviceSection
    grid: GridSection
    guide: GuideSection = GuideSection()

    @classmethod
    def of(cls, **flat) -> SampleConfig:
        """From flat options (``ckpt=..., num_sampling_steps=10``), for library callers."""
        return cls(**SAMPLE_FACE.of(**flat))


@dataclass(frozen=True)
class FidConfig:
    weights: WeightsSection
    sampling: FidSamplingSection
    runtime: SamplingDeviceSection
    fid: FidSetSection
    guide: GuideSection = GuideSection()

    @classmethod
    def of(cls, **flat) -> FidConfig:
        return cls(**FID_FACE.of(**flat))


SAMPLE_FACE = Face(
    "sample.py",
    """Sample a grid of class-conditional images from a DiT checkpoint (ours or an official release).

python sample.py --ckpt results/DiT-XL-2-256/checkpoints/0400000.pt --guidance-scale 4 --out sample.png
python sample.py --model DiT-XL/2 --image-size 256 --ckpt DiT-XL-2-256x256.pt   # official weights

A run's checkpoints are RESULTS_DIR/checkpoints/STEP.pt: results/DiT-XL-2-256 is the folder of
`train.py --config configs/DiT-XL-2-256.yaml`, results/run that of a run without a preset or --results-dir.""",
    sections={"weights": WeightsSection, "sampling": SamplingSection, "runtime": SamplingDeviceSection,
              "grid": GridSection, "guide": (GuideSection, GUIDE_PREFIX)},
    outputs={"out": "file"},
    inputs=SAMPLING_INPUTS,
)  # fmt: skip
FID_FACE = Face(
    "scripts/sample_ddp.py",
    """Write an FID sample set: PNGs and an .npz (arr_0 images, arr_1 labels) for the ADM evaluator.

torchrun --nproc_per_node=8 scripts/sample_ddp.py --ckpt DiT-XL-2-256x256.pt --model DiT-XL/2

Image i is seeded by (seed, i), so the set is the same on any number of devices; rerunning the same command
after a kill finishes the set without duplicates or gaps.""",
    sections={"weights": WeightsSection, "sampling": FidSamplingSection, "runtime": SamplingDeviceSection,
              "fid": FidSetSection, "guide": (GuideSection, GUIDE_PREFIX)},
    outputs={"sample_dir": "folder"},
    inputs=SAMPLING_INPUTS,
)  # fmt: skip


def parse_sample_config(argv: list[str] | None = None) -> SampleConfig:
    return SampleConfig(**SAMPLE_FACE.parse(argv).sections)


def parse_fid_config(argv: list[str] | None = None) -> FidConfig:
    return FidConfig(**FID_FACE.parse(argv).sections)
