"""dit.data.vae: loading by folder/alias/hub id, the scaling rule, posterior sampling, decoding, clear failures."""

import os

import huggingface_hub.constants
import pytest
import torch
from helpers import build_tiny_vae

from dit.data.vae import (
    decode,
    encode,
    encode_moments,
    load_vae,
    resolve_vae_spec,
    sample_posterior,
    scaling_factor,
    vae_id_and_config_hash,
    weights_sha256,
)
from dit.io.errors import UserError


@pytest.fixture
def vae_dir(tmp_path):
    vae = build_tiny_vae(seed=3)
    vae.register_to_config(scaling_factor=0.25)  # not the default, so a hard-coded 0.18215 would be caught
    vae.save_pretrained(tmp_path / "vae")
    return str(tmp_path / "vae"), vae


def test_load_from_folder_round_trips_weights_and_reads_scaling_factor(vae_dir):
    path, original = vae_dir
    vae = load_vae(path)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    assert weights_sha256(vae) == weights_sha256(original)
    assert scaling_factor(vae) == 0.25
    vae_id, config_hash = vae_id_and_config_hash(vae, path)
    assert vae_id == os.path.abspath(path)
    assert vae_id_and_config_hash(original, path)[1] == config_hash
    other = build_tiny_vae(seed=3, latent_channels=8)
    assert vae_id_and_config_hash(other, path)[1] != config_hash


def test_weights_hash_tells_apart_vaes_with_the_same_config():
    a, b = build_tiny_vae(seed=0), build_tiny_vae(seed=1)
    assert vae_id_and_config_hash(a, "ema")[1] == vae_id_and_config_hash(b, "ema")[1]
    assert weights_sha256(a) != weights_sha256(b)


def test_aliases_and_hub_ids_resolve():
    assert resolve_vae_spec("ema") == "stabilityai/sd-vae-ft-ema"
    assert resolve_vae_spec("mse") == "stabilityai/sd-vae-ft-mse"
    assert resolve_vae_spec("someone/their-vae") == "someone/their-vae"


def test_encode_is_a_scaled_posterior_sample(vae_dir):
    vae = load_vae(vae_dir[0])
    images = torch.rand(3, 3, 32, 32) * 2 - 1
    mean, std = encode_moments(vae, images)
    assert mean.shape == std.shape == (3, 4, 4, 4) and (std > 0).all()
    z = encode(vae, images, generator=torch.Generator().manual_seed(7))
    expected = (mean + std * torch.randn(mean.shape, generator=torch.Generator().manual_seed(7))) * 0.25
    torch.testing.assert_close(z, expected)
    assert not torch.allclose(z, mean * 0.25)  # a sample, not the mean


def test_sample_latents_has_the_posterior_statistics():
    mean = torch.tensor([[-2.0, 0.5], [3.0, 0.0]])
    std = torch.tensor([[0.1, 1.0], [2.0, 0.5]])
    draws = torch.stack([sample_posterior(mean, std, 0.5) for _ in range(20000)])
    torch.testing.assert_close(draws.mean(0), mean * 0.5, atol=0.03, rtol=0)
    torch.testing.assert_close(draws.std(0), std * 0.5, atol=0.03, rtol=0.03)


def test_decode_divides_by_the_scaling_factor_and_clamps(vae_dir):
    vae = load_vae(vae_dir[0])
    z = torch.randn(2, 4, 4, 4) * 40
    images = decode(vae, z)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert images.min() >= -1 and images.max() <= 1
    torch.testing.assert_close(images, vae.decode(z / 0.25).sample.clamp(-1, 1))


def test_bf16_load_keeps_the_dtype(vae_dir):
    vae = load_vae(vae_dir[0], dtype=torch.bfloat16)
    assert next(vae.parameters()).dtype == torch.bfloat16
    assert encode_moments(vae, torch.zeros(1, 3, 32, 32))[0].dtype == torch.bfloat16


def test_missing_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"does-not-exist.*does not exist.*--vae ema"):
        load_vae(str(tmp_path / "does-not-exist"))


def test_folder_without_config_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"no config.json.*save_pretrained"):
        load_vae(str(tmp_path))


def test_corrupt_weights_are_a_user_error(vae_dir):
    path = vae_dir[0]
    with open(os.path.join(path, "diffusion_pytorch_model.safetensors"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(UserError, match=r"cannot load VAE .*Fix: re-save it"):
        load_vae(path)


def test_offline_hub_id_is_a_user_error_naming_the_fix(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError, match=r"stabilityai/sd-vae-ft-mse.*hf download .*--vae DIR"):
        load_vae("mse")


def test_sd3_style_vae_shifts_then_scales_16_channel_latents(tmp_path):
    """The SD3/FLUX family: 16 latent channels and latent = (z - shift_factor) x scaling_factor."""
    vae = build_tiny_vae(latent_channels=16)
    vae.register_to_config(shift_factor=0.1, scaling_factor=1.5)
    vae.save_pretrained(tmp_path)
    vae = load_vae(str(tmp_path))
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    mean, std = encode_moments(vae, images)
    z = encode(vae, images, generator=torch.Generator().manual_seed(3))
    eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(z, (mean + std * eps - 0.1) * 1.5)
    assert z.shape == (2, 16, 4, 4)
    torch.testing.assert_close(decode(vae, z), vae.decode(z / 1.5 + 0.1).sample.clamp(-1, 1))
