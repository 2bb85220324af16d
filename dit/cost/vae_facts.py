"""What the planner and the VAE loader must agree on about the autoencoders, without torch or diffusers:
the SD VAE's aliases and config, diffusers' AutoencoderKL defaults, and the downsampling a config implies.
``dit.data.vae`` loads and runs VAEs from these; ``dit.cost`` counts their FLOPs and latent shapes from them."""

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


def latent_downsample_of(config) -> int:
    """Image pixels per latent pixel along one side, from an AutoencoderKL config (a dict or diffusers'
    FrozenDict): each encoder block but the last halves the resolution."""
    blocks = config.get("block_out_channels", AUTOENCODER_KL_DEFAULTS["block_out_channels"])
    return 2 ** (len(blocks) - 1)


def latent_channels_of(config) -> int:
    return int(config.get("latent_channels", AUTOENCODER_KL_DEFAULTS["latent_channels"]))
