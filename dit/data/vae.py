"""The frozen image autoencoder: loading, encoding, decoding, and the one place of the latent scaling rule,
(posterior sample - ``shift_factor``) x ``scaling_factor``, and of ``--latent-norm channel`` (``ChannelNorm``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import typing
from dataclasses import dataclass

import torch

if typing.TYPE_CHECKING:  # diffusers loads on first use: the trainer and sampler run without it in pixel space
    from diffusers import AutoencoderKL

from dit.cost.vae_facts import VAE_ALIASES, VAVAE_ID, is_vavae, latent_downsample_of
from dit.io.errors import UserError, require

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_vae_spec(spec: str) -> str:
    """An alias becomes its hub id; a folder becomes its absolute path; a hub id stays as it is."""
    if spec in VAE_ALIASES:
        return VAE_ALIASES[spec]
    path = os.path.expanduser(spec)
    if os.path.exists(path):
        return os.path.abspath(path)
    if _HUB_ID.match(spec):
        return spec
    raise UserError(
        f"VAE folder {spec!r} does not exist. Pass --vae ema, --vae mse, a Hugging Face hub id "
        "(owner/name), or a folder written by AutoencoderKL.save_pretrained."
    )


def load_vae(spec: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> AutoencoderKL:
    """Load a frozen AutoencoderKL in eval mode; failures become a UserError that names the source and the fix."""
    if is_vavae(spec):
        raise UserError(
            f"VA-VAE's release ({VAVAE_ID}) is an LDM checkpoint, which diffusers does not load: convert it to a "
            "diffusers AutoencoderKL folder (its layers: dit.cost.vae_facts.VAVAE_CONFIG) and pass --vae DIR "
            "(dit-cost prices --vae vavae by name)."
        )
    source = resolve_vae_spec(spec)
    is_folder = os.path.isabs(source)
    if is_folder and not os.path.isfile(os.path.join(source, "config.json")):
        raise UserError(
            f"VAE folder {source} has no config.json. Point --vae at a folder written by "
            "AutoencoderKL.save_pretrained (config.json + diffusion_pytorch_model.safetensors)."
        )
    diffusers = require("diffusers", "vae", "a VAE (latent-space training, extraction, decoding)")
    try:
        vae = diffusers.AutoencoderKL.from_pretrained(source, torch_dtype=dtype)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        if is_folder:
            fix = "re-save it with AutoencoderKL.save_pretrained, or pass --vae ema|mse"
        else:
            fix = (
                f"connect to the internet once so it is cached, or download it elsewhere with "
                f"`hf download {source} --local-dir DIR`, copy DIR here and pass --vae DIR"
            )
        raise UserError(f"cannot load VAE {source!r}: {first_line}. Fix: {fix}.") from e
    return vae.to(device).eval().requires_grad_(False)


def vae_id_and_config_hash(vae: AutoencoderKL, spec: str) -> tuple[str, str]:
    """A readable id and a sha256 of the config without diffusers' ``_*`` keys (a copy hashes equal)."""
    vae_id = resolve_vae_spec(spec)
    config = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    blob = json.dumps(config, sort_keys=True, default=list).encode()
    return vae_id, hashlib.sha256(blob).hexdigest()


def weights_sha256(vae: AutoencoderKL) -> str:
    """A sha256 of the weights as float32 bytes: the VAE's identity (a bf16-loaded VAE differs, rightly)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(vae.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def scaling_factor(vae: AutoencoderKL) -> float:
    """The factor that brings latents to roughly unit variance (0.18215 for the SD VAEs), from the config."""
    return float(vae.config.scaling_factor)


def shift_factor(vae: AutoencoderKL) -> float:
    """The latents' offset before scaling (0 for the SD VAEs; 0.0609 for SD3's, 0.1159 for FLUX's)."""
    return float(getattr(vae.config, "shift_factor", None) or 0.0)


def latent_downsample(vae: AutoencoderKL) -> int:
    """Image pixels per latent pixel along one side (``dit.cost.vae_facts``, the rule the planner uses too)."""
    return latent_downsample_of(vae.config)


@torch.no_grad()
def encode_moments(vae: AutoencoderKL, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior's unscaled (mean, std) for images in [-1, 1], under the caller's ``Precision.frozen()``."""
    posterior = vae.encode(images.to(dtype=vae.dtype)).latent_dist
    return posterior.mean, posterior.std


def sample_posterior(
    mean: torch.Tensor,
    std: torch.Tensor,
    scale: float,
    generator: torch.Generator | None = None,
    shift: float = 0.0,
    eps: torch.Tensor | None = None,
) -> torch.Tensor:
    """(mean + std * eps - shift) * scale in float32, in place on the noise (``eps`` drawn here unless given)."""
    if eps is None:
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
    else:
        eps = eps.to(torch.float32, copy=True)
    return eps.mul_(std).add_(mean).sub_(shift).mul_(scale)


def encode(
    vae: AutoencoderKL,
    images: torch.Tensor,
    generator: torch.Generator | None = None,
    eps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Images in [-1, 1] to scaled latents, as DiT trains on them (a posterior sample, not the mean)."""
    return sample_posterior(*encode_moments(vae, images), scaling_factor(vae), generator, shift_factor(vae), eps)


@dataclass(frozen=True)
class ChannelNorm:
    """``--latent-norm channel``: z' = (z - mean_c) / std_c with a store's statistics (LightningDiT's), float32."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def of(cls, stats: dict) -> ChannelNorm:
        """From a store's or a checkpoint's record (``{"mean": [...], "std": [...]}``)."""
        return cls(tuple(float(m) for m in stats["mean"]), tuple(float(s) for s in stats["std"]))

    def record(self) -> dict:
        """What a checkpoint keeps, so that its samples can be decoded without the store."""
        return {"kind": "channel", "mean": list(self.mean), "std": list(self.std)}

    def describe(self) -> str:
        means, stds = (", ".join(f"{v:.4g}" for v in values) for values in (self.mean, self.std))
        return f"latents normalised per channel (--latent-norm channel): means {means}; stds {stds}"

    def _stats(self, z: torch.Tensor) -> list[torch.Tensor]:
        return [z.new_tensor(v, dtype=torch.float32).view(-1, 1, 1) for v in (self.mean, self.std)]

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latents ``[..., C, H, W]`` to the model's, float32."""
        mean, std = self._stats(z)
        return (z.float() - mean) / std

    def undo(self, latents: torch.Tensor) -> torch.Tensor:
        """The model's latents back to unscaled ones, float32."""
        mean, std = self._stats(latents)
        return latents.float() * std + mean


@torch.no_grad()
def decode(vae: AutoencoderKL, latents: torch.Tensor, channel: ChannelNorm | None = None) -> torch.Tensor:
    """Scaled latents (per channel with ``channel``) back to float32 images in [-1, 1]."""
    z = channel.undo(latents) if channel is not None else latents / scaling_factor(vae) + shift_factor(vae)
    images = vae.decode(z.to(dtype=vae.dtype)).sample
    return images.float().clamp_(-1.0, 1.0)
