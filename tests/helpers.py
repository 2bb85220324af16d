"""Helpers shared by several test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import csv
import functools
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dit.checkpoint import save_training_checkpoint
from dit.io.cli import run_cli
from dit.model.dit import DiT

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"  # ground truth copied from the spec (data/README.md)
TINY = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=10)


def block_option_sets() -> dict[str, dict]:
    """Each block option alone (every registry entry but the official first, every switch) and all of them
    together, read from ``dit.model.options``: a new option is tested without editing a list."""
    from dit.model.options import CHOICES, SWITCHES

    sets = {entry: {field: entry} for field, registry in CHOICES.items() for entry in list(registry)[1:]}
    sets.update({name: {name: True} for name in SWITCHES})
    return {**sets, "all": {k: v for options in sets.values() for k, v in options.items()}}


def spec_rows() -> list[dict]:
    """The 13 rows of tests/data/dit_configs.csv (official parameter counts and forward GMACs)."""
    with open(DATA / "dit_configs.csv") as f:
        return list(csv.DictReader(f))


def randomize(model: DiT, seed: int, std: float = 0.1) -> DiT:
    """Redraw every weight but the fixed position table (a fresh DiT is adaLN-Zero: it outputs exactly 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def tiny_dit(seed: int = 0, **overrides) -> DiT:
    return randomize(DiT(**{**TINY, **overrides}), seed)


def write_our_checkpoint(folder: Path, vae: str | None, seed: int = 0, **overrides) -> Path:
    """A checkpoint as train.py writes it: raw and EMA weights differ, the run config names the VAE."""
    model, ema = tiny_dit(seed, **overrides), tiny_dit(seed + 1, **overrides)
    cfg = model.config
    image_size = cfg.input_size * (8 if vae else 1)
    payload = {
        "model": model.state_dict(),
        "ema": ema.state_dict(),
        "optimizer": {},
        "config": {"model": "custom", "image_size": image_size, "vae": vae, "num_classes": cfg.num_classes},
        "model_config": cfg.to_dict(),
    }
    return save_training_checkpoint(folder, 100, payload)


def build_tiny_vae(seed: int = 0, latent_channels: int = 4):
    """A random 6.8k-parameter AutoencoderKL with the SD VAE's interface and 8x downsampling.

    The real 84M-parameter VAE (about 2 s per 256 px image here) is too slow for tests and cannot be
    downloaded; this one's latents mean nothing."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        vae = AutoencoderKL(
            block_out_channels=[4, 4, 4, 4],
            down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4,
            layers_per_block=1,
            norm_num_groups=2,
            latent_channels=latent_channels,
            sample_size=32,
        )
    return vae.eval().requires_grad_(False)


def face(relative_path: str):
    """A command-line module imported without running it (a package's ``__main__`` by its dotted name)."""
    path = ROOT / relative_path
    if relative_path.startswith("dit/"):
        return importlib.import_module(relative_path.removesuffix(".py").replace("/", "."))
    if str(path.parent) not in sys.path:  # as Python runs a script: its folder first (studies import siblings)
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# Every command line users run, by the name the docs call it, as the module that holds its ``FACE``.
FACE_MODULES = {
    "train.py": "train.py",
    "sample.py": "sample.py",
    "extract_features.py": "extract_features.py",
    "scripts/sample_ddp.py": "scripts/sample_ddp.py",
    "scripts/export_diffusers.py": "scripts/export_diffusers.py",
    "scripts/benchmark.py": "scripts/benchmark.py",
    "studies/scaling.py": "studies/scaling.py",
    "studies/sampling_study.py": "studies/sampling_study.py",
    "studies/sampling_verdicts.py": "studies/sampling_verdicts.py",
    "studies/after_training.py": "studies/after_training.py",
    "studies/sample_count.py": "studies/sample_count.py",
    "studies/eval_figures.py": "studies/eval_figures.py",
    "dit-cost": "dit/cost/__main__.py",
    "dit.cost": "dit/cost/__main__.py",
    "dit.eval": "dit/eval/__main__.py",
    "dit.quickstart": "dit/quickstart/run.py",
    "dit.checkpoint": "dit/checkpoint/__main__.py",
    "studies/train_digit_classifier.py": "studies/train_digit_classifier.py",
    "studies/train_digit_encoder.py": "studies/train_digit_encoder.py",
    "studies/train_digit_judge.py": "studies/train_digit_judge.py",
}


@functools.lru_cache(maxsize=1)
def faces() -> dict:
    """{name: Face} of every command line (``dit.eval ref`` included)."""
    out = {name: face(path).FACE for name, path in FACE_MODULES.items()}
    out["dit.eval ref"] = face("dit/eval/__main__.py").REF_FACE
    return out


def run_face(relative_path: str, argv: list[str], capsys) -> tuple[int, str, str]:
    code = run_cli(face(relative_path).main, argv)
    out, err = capsys.readouterr()
    return code, out, err


def make_image_folder(root, counts=None, seed=0):
    """A synthetic ImageNet-style folder of random RGB images, 32-64 px on each side, plus three problems:
    a corrupt JPEG, a non-image file, and an empty class folder (``c_empty``)."""
    rng = np.random.default_rng(seed)
    counts = counts or {"a_cat": 4, "b_dog": 3}
    for name, count in counts.items():
        os.makedirs(os.path.join(root, name), exist_ok=True)
        for i in range(count):
            size = tuple(int(s) for s in rng.integers(32, 65, 2))
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(os.path.join(root, name, f"img{i}.png"))
    first = sorted(counts)[0]
    with open(os.path.join(root, first, "broken.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 truncated")
    with open(os.path.join(root, first, "notes.txt"), "w") as f:
        f.write("not an image")
    os.makedirs(os.path.join(root, "c_empty"), exist_ok=True)
    return str(root)


def random_inception_weights(path, seed: int = 0) -> str:
    """torch-fidelity's Inception-v3 state dict with random He-scaled weights (its default initialisation
    fades to ~1e-8 by pool3), saved as a .pth like its real weights file: the architecture, offline."""
    from dit.eval.inception import InceptionFeatures

    g = torch.Generator().manual_seed(seed)
    state = InceptionFeatures(None, "random").net.state_dict()
    for name, tensor in state.items():
        if name.endswith("conv.weight") or name == "fc.weight":
            fan_in = tensor[0].numel()
            tensor.copy_(torch.randn(tensor.shape, generator=g) * (2.0 / fan_in) ** 0.5)
    torch.save(state, path)
    return str(path)


def random_vit_weights(path, name: str = "test_vit", seed: int = 0) -> str:
    """A timm ViT's state dict with timm's random initialisation (``pretrained=False``), saved as safetensors:
    an encoder for REPA offline (``--repa-encoder NAME --repa-encoder-weights PATH``); its features mean nothing."""
    import timm
    from safetensors.torch import save_file

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = timm.create_model(name, pretrained=False, num_classes=0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path)
