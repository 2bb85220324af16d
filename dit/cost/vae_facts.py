"""What the planner and the VAE loader agree on about the autoencoders, without torch or diffusers: the SD VAE's
aliases and config, VA-VAE's, diffusers' AutoencoderKL defaults, and the downsampling a config implies."""

from __future__ import annotations

# DiT's VAEs: the same encoder (one latent space), decoders fine-tuned on different losses.
VAE_ALIASES = {"ema": "stabilityai/sd-vae-ft-ema", "mse": "stabilityai/sd-vae-ft-mse"}

# The config stabilityai/sd-vae-ft-ema and -mse share (their config.json, the keys the FLOPs depend on).
SD_VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "norm_num_groups": 32,
    "act_fn": "silu",
}

# VA-VAE (LightningDiT's vavae_f16d32.yaml) as an AutoencoderKL of its layers: priced by name, LDM-format release
VAVAE_ID = "hustvl/vavae-imagenet256-f16d32-dinov2"
VAVAE_CONFIG = {
    **SD_VAE_CONFIG,
    "latent_channels": 32,
    "block_out_channels": [128, 128, 256, 256, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4 + ["AttnDownEncoderBlock2D"],
    "up_block_types": ["AttnUpDecoderBlock2D"] + ["UpDecoderBlock2D"] * 4,
}

# diffusers' own AutoencoderKL defaults, for keys a config leaves out.
AUTOENCODER_KL_DEFAULTS = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "block_out_channels": [64],
    "layers_per_block": 1,
    "down_block_types": ["DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D"],
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "mid_block_add_attention": True,
}


def is_sd_vae(spec: str | None) -> bool:
    """The SD VAEs (ema, mse, their hub ids) share one encoder, hence one latent space."""
    return spec in (*VAE_ALIASES, *VAE_ALIASES.values())


def is_vavae(spec: str | None) -> bool:
    """VA-VAE by its alias (vavae) or hub id."""
    return spec in ("vavae", VAVAE_ID)


def known_vae_config(spec: str | None) -> dict | None:
    """The config of a VAE known by alias or hub id (the SD VAEs, VA-VAE), priced without a download; else None."""
    if is_sd_vae(spec):
        return SD_VAE_CONFIG
    return VAVAE_CONFIG if is_vavae(spec) else None


def latent_downsample_of(config) -> int:
    """Image pixels per latent pixel along a side: each encoder block but the last halves the resolution."""
    blocks = config.get("block_out_channels", AUTOENCODER_KL_DEFAULTS["block_out_channels"])
    return 2 ** (len(blocks) - 1)
