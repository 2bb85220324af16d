"""The DiT a checkpoint holds, and the VAE to decode its samples: ours, official train.py files, releases."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dit.checkpoint import load_checkpoint, model_weights, official_release
from dit.cost.vae_facts import is_sd_vae
from dit.data.vae import ChannelNorm, latent_downsample, load_vae
from dit.io.config import Section, flatten_record, option
from dit.io.errors import UserError
from dit.model.config import DiTConfig, describe, model_config_from_shapes, registry_name
from dit.model.dit import DiT
from dit.objectives import OBJECTIVES, from_record
from dit.objectives.times import latent_dim
from dit.sample.generate import SamplingModel


@dataclass(frozen=True)
class WeightsSection(Section):
    """Which weights to sample, and what a file without a record needs said about them."""

    ckpt: str | None = option(
        None,
        "our training checkpoint, an official train.py file, or a bare state dict (default: the official "
        "DiT-XL-2-<image size>.pt release, downloaded if missing)",
    )
    ema: bool = option(True, "the EMA weights (--no-ema: the raw weights)")
    model: str | None = option(None, "for files without a config (default: read from the weights' shapes)")
    image_size: int | None = option(None, "pixels per side, for files without a config (default 256)", ge=1)
    num_classes: int | None = option(None, "for files without a config (default: read from the weights)", ge=0)
    num_heads: int | None = option(
        None, "for a bare state dict whose width is no registry size (a head count is in no weight's shape)", ge=1
    )
    vae: str | None = option(
        None, "ema, mse, a hub id, a folder, or none (default: as the official scripts, or the run's own VAE)"
    )
    objective: str | None = option(
        None, "for files without a config: flow for a SiT release (default: as recorded, else diffusion)",
        choices=tuple(OBJECTIVES),
    )  # fmt: skip


def load_weights(w: WeightsSection, device, sd_decoder: str = "mse") -> SamplingModel:
    """``load_sampling_model`` for a weights section (``sd_decoder``: the official script's SD decoder)."""
    return load_sampling_model(
        w.ckpt, model=w.model, image_size=w.image_size, num_classes=w.num_classes, num_heads=w.num_heads, vae=w.vae,
        use_ema=w.ema, device=device, sd_decoder=sd_decoder, objective=w.objective,
    )  # fmt: skip


def recorded_run_config(ckpt: dict) -> dict:
    """A checkpoint's run as flat options: ours under ``config``, official train.py's under ``args``."""
    for key in ("config", "args"):
        if isinstance(ckpt.get(key), dict):
            return flatten_record(ckpt[key])
    return {}


def sit_run_config(run: dict) -> dict:
    """SiT's ``args`` (path_type "Linear", "SiT-XL/2", no objective) under our names: the same flow model."""
    if "path_type" not in run or "objective" in run:
        return run
    run = {**run, "objective": "flow", "path_type": str(run["path_type"]).lower()}
    run["loss_weight"] = str(run.get("loss_weight") or "none").lower()
    if isinstance(run.get("model"), str):
        run["model"] = run["model"].replace("SiT-", "DiT-")  # SiT's networks are DiT's
    return run


def _agree(flag: str, given, recorded):
    """The recorded value unless the user asked for a different one, which is a mistake worth naming."""
    if given is not None and recorded is not None and given != recorded:
        raise UserError(
            f"{flag} {given} does not match the checkpoint, which was trained with {flag} {recorded}: "
            f"drop {flag} or pass {recorded}."
        )
    return given if given is not None else recorded


def load_sampling_model(
    ckpt_path: str | os.PathLike | None,
    *,
    image_size: int | None = None,
    vae: str | None = None,
    device: str | torch.device = "cpu",
    sd_decoder: str = "mse",
    **read,
) -> SamplingModel:
    """The DiT a checkpoint holds (a bare release read from its shapes) and the VAE to decode its samples;
    ``read``: ``read_model``'s model, num_classes, num_heads, use_ema and objective."""
    ckpt_path = ckpt_path or official_release(image_size)  # as the official sample.py; downloaded if missing
    net, which, run, latent_norm = read_model(ckpt_path, device=device, **read)
    vae_spec, vae_module = _decoder(run, vae, sd_decoder, device)
    factor = 1 if vae_module is None else latent_downsample(vae_module)
    image_size = _agree("--image-size", image_size, run.get("image_size")) or net.config.input_size * factor
    _check_fits(net.config, image_size, factor, vae_spec, vae_module)
    objective = recorded_objective(run, net.config)
    return SamplingModel.from_objective(net, which, image_size, vae_module, vae_spec, objective, latent_norm)


def read_model(
    ckpt_path: str | os.PathLike,
    *,
    model: str | None = None,
    num_classes: int | None = None,
    num_heads: int | None = None,
    use_ema: bool = True,
    device: str | torch.device = "cpu",
    objective: str | None = None,
) -> tuple[DiT, str, dict, ChannelNorm | None]:
    """``load_sampling_model`` without the VAE: (DiT, which weights, flat record, latent statistics)."""
    ckpt = load_checkpoint(ckpt_path)
    run = sit_run_config(recorded_run_config(ckpt))
    recorded_objective = run.get("objective") or ("diffusion" if run else None)
    run["objective"] = _agree("--objective", objective, recorded_objective) or "diffusion"
    weights, which = model_weights(ckpt, use_ema)
    cfg = _model_config(ckpt, weights, run, model=model, num_classes=num_classes, num_heads=num_heads)
    net = DiT.from_config(cfg)
    net.load_weights(weights, source=f"{ckpt_path} ({which} weights)")
    latent_norm = None  # the VAE's scale; a --latent-norm channel run's statistics undo its normalisation
    if run.get("latent_norm", "scalar") != "scalar":
        if not isinstance(ckpt.get("latent_norm"), dict):
            raise UserError(
                "the checkpoint was trained with --latent-norm channel but holds no per-channel statistics to undo "
                "it with: it is damaged or was edited; sample a checkpoint its run wrote."
            )
        latent_norm = ChannelNorm.of(ckpt["latent_norm"])
    return net.to(device).eval().requires_grad_(False), which, run, latent_norm


def recorded_objective(run: dict, cfg: DiTConfig):
    """The objective a checkpoint's record (``read_model``'s ``run``) says its model was trained with."""
    return from_record(run, cfg.learn_sigma, latent_dim(cfg))


def _decoder(run: dict, vae: str | None, sd_decoder: str, device):
    """(spec, module) of the VAE that decodes the samples, ``vae`` checked against the record; None for pixels."""
    recorded_pixel = "vae" in run and run["vae"] in (None, "none")
    if vae == "none" and "vae" in run and not recorded_pixel:
        raise UserError(
            f"--vae none asks for a pixel-space model, but the checkpoint was trained on {run['vae']!r} latents: "
            "drop --vae none (or pass a VAE such as --vae mse)."
        )
    if vae not in (None, "none") and recorded_pixel:
        raise UserError(f"the checkpoint is a pixel-space model (trained without a VAE): drop --vae {vae}.")
    if recorded_pixel or vae == "none":
        return None, None
    recorded_vae = run.get("vae")
    sd_family = recorded_vae is None or is_sd_vae(recorded_vae)
    vae_spec = vae or (sd_decoder if sd_family else recorded_vae)
    return vae_spec, load_vae(vae_spec, device=device, dtype=torch.float32)


def _model_config(ckpt: dict, weights: dict, run: dict, *, model, num_classes, num_heads) -> DiTConfig:
    """The recorded model config, else one read from the weights' shapes, checked against ``model``."""
    if "model_config" in ckpt:
        cfg = DiTConfig(**ckpt["model_config"])
        name = registry_name(cfg) or "custom"
        if model is not None and model != name:
            raise UserError(f"--model {model} does not match the checkpoint, which holds {name}: drop --model.")
    else:
        cfg = model_config_from_shapes({k: tuple(v.shape) for k, v in weights.items()}, num_heads)
        name = registry_name(cfg) or "custom"
        for given in (model, run.get("model")):
            if given is not None and given != name:
                raise UserError(
                    f"--model {given} does not match the checkpoint, whose weights are {describe(cfg)}: drop --model."
                )
    _agree("--num-classes", num_classes, cfg.num_classes)
    return cfg


def _check_fits(cfg: DiTConfig, image_size: int, factor: int, vae_spec: str | None, vae_module) -> None:
    """The model's input against the image size and the VAE's latents (or pixels)."""
    if cfg.input_size * factor != image_size:
        raise UserError(
            f"--image-size {image_size} needs a model input of {image_size // factor}, but the checkpoint's model "
            f"takes {cfg.input_size}: pass --image-size {cfg.input_size * factor}."
        )
    if vae_module is not None and cfg.in_channels != vae_module.config.latent_channels:
        raise UserError(
            f"the checkpoint's model takes {cfg.in_channels}-channel latents, but VAE {vae_spec!r} makes "
            f"{vae_module.config.latent_channels}: pass the VAE it was trained with (--vae)."
        )
    if vae_module is None and cfg.in_channels not in (1, 3):
        raise UserError(
            f"a pixel-space model must make 1- or 3-channel images, this one has {cfg.in_channels} channels: "
            "pass the VAE it was trained with (--vae)."
        )
