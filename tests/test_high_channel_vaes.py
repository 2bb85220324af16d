"""Patch-1 models on VAEs of any channel count and downsampling: the latents' shape flows from the VAE's config
into the store, the model and the planner; a patch that does not divide the latent, or a checkpoint of other
latents, is one line; and LightningDiT's 64 epochs priced against DiT-XL/2's 7M steps."""

import json

import pytest
from helpers import build_tiny_vae, make_image_folder, run_face

from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.cost.__main__ import main as dit_cost
from dit.cost.analytic import vae_flops
from dit.cost.plan import vae_config_for

TINY = ["--depth", "2", "--hidden-size", "32", "--num-heads", "2"]
RUN = ["--num-classes", "3", "--global-batch-size", "4", "--max-steps", "2", "--precision", "fp32",
       "--num-workers", "0", "--peak-tflops", "0.05", "--ckpt-every", "1000"]  # fmt: skip
LIGHTNINGDIT = ["--model", "DiT-XL/1", "--vae", "vavae", "--image-size", "256", "--mlp", "swiglu", "--norm", "rmsnorm",
                "--rope", "--no-learn-sigma", "--global-batch-size", "1024", "--max-steps", "80000"]  # fmt: skip
DIT_XL2 = ["--model", "DiT-XL/2", "--image-size", "256", "--global-batch-size", "256", "--max-steps", "7000000"]


def _json(capsys, *argv) -> dict:
    assert dit_cost([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _files(folder) -> dict:
    """What a run folder holds, but its lock (taken by every start)."""
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}


def _vae_4x(path, channels: int) -> str:
    """A random AutoencoderKL of ``channels`` latent channels at 4x downsampling (three encoder blocks)."""
    vae = build_tiny_vae(latent_channels=channels)
    config = {**dict(vae.config), "block_out_channels": [4, 4, 4]}
    config["down_block_types"], config["up_block_types"] = (
        vae.config.down_block_types[:3],
        vae.config.up_block_types[:3],
    )
    type(vae).from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def vae4x8(tmp_path_factory):
    return _vae_4x(tmp_path_factory.mktemp("vae4x8"), 8)


def test_lightningdit_64_epochs_cost_about_1_22_of_dit_xl2_7m_steps(capsys):
    light, xl2 = _json(capsys, "train", *LIGHTNINGDIT), _json(capsys, "train", *DIT_XL2)
    assert light["description"].startswith("DiT-XL/1, input 32x16x16") and light["images"] == 80_000 * 1024
    ratio = light["total_flops"] / xl2["total_flops"]
    print(
        f"LightningDiT XL/1 64 epochs / DiT-XL/2 7M steps: {ratio:.5f} = 1/{1 / ratio:.1f} of the training FLOPs"
    )
    per_image = light["train_gflops_per_image"] / xl2["train_gflops_per_image"]  # 256 tokens each
    assert ratio == pytest.approx(per_image * light["images"] / xl2["images"])
    assert abs(per_image - 1) < 0.01 and 1 / 30 < ratio < 1 / 15


def test_a_vae_of_other_channels_and_downsampling_flows_into_store_model_and_planner(tmp_path, capsys, vae4x8):
    from dit.extract import ExtractConfig, extract_features

    images = make_image_folder(tmp_path / "images", {"a": 3, "b": 3})
    store = tmp_path / "store"
    extract_features(
        ExtractConfig(feature_path=str(store), data_path=images, image_size=32, vae=vae4x8, num_workers=0)
    )
    assert json.loads((store / "manifest.json").read_text())["latent_shape"] == [8, 8, 8]
    code, _, err = run_face("train.py", ["--model", "DiT-S/1", *TINY, "--image-size", "32", "--feature-path",
                                         str(store), "--results-dir", str(tmp_path / "run"), *RUN], capsys)  # fmt: skip
    assert code == 0, err
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    model = load_checkpoint(ckpt)["model_config"]
    assert (model["in_channels"], model["input_size"], model["patch_size"]) == (8, 8, 1)
    code, _, err = run_face("sample.py", ["--ckpt", str(ckpt), "--num-sampling-steps", "2", "--precision", "fp32",
                                          "--peak-tflops", "1", "--out", str(tmp_path / "g.png")], capsys)  # fmt: skip
    assert code == 0 and (tmp_path / "g.png").is_file(), err  # decoded by the store's VAE: 32 px images
    planned = _json(capsys, "train", "--model", "DiT-S/1", *TINY, "--image-size", "32", "--vae", vae4x8)
    assert (planned["description"], planned["vae_encode_gflops_per_image"]) == (
        "custom (depth 2, hidden 32, patch 1), input 8x8x8, 1000 classes",
        vae_flops(vae_config_for(vae4x8), 32).encode / 1e9,
    )


def test_a_patch_that_does_not_divide_the_latent_is_one_line(tmp_path, capsys, vae4x8):
    images = make_image_folder(tmp_path / "images", {"a": 3})
    argv = ["--model", "DiT-S/8", *TINY, "--image-size", "16", "--data-path", images, "--vae", vae4x8, *RUN,
            "--results-dir", str(tmp_path / "run")]  # fmt: skip
    code, out, err = run_face("train.py", argv, capsys)  # 16 px / 4 = a 4x4 latent
    assert (
        code == 2
        and err.count("\n") == 1
        and err.startswith("error: input size 4 is not divisible by patch size 8")
    )
    assert {p.name for p in (tmp_path / "run").rglob("*")} <= {".lock"}  # nothing written but the run's lock
    assert dit_cost(["flops", "--model", "DiT-XL/8", "--vae", "vavae", "--image-size", "64"]) == 2
    assert capsys.readouterr().err.startswith("error: input size 4 is not divisible by patch size 8")


def test_resuming_or_sampling_on_latents_of_other_channels_is_one_line(tmp_path, capsys, vae4x8, vae_dir):
    images = make_image_folder(tmp_path / "images", {"a": 2, "b": 2})
    (tmp_path / "images" / "a" / "broken.jpg").unlink()  # read on the fly: a corrupt image stops the run
    run = ["--model", "DiT-S/1", *TINY, "--image-size", "32", "--data-path", images, *RUN,
           "--results-dir", str(tmp_path / "run")]  # fmt: skip
    assert run_face("train.py", [*run, "--vae", vae4x8], capsys)[0] == 0
    before = _files(tmp_path / "run")
    code, _, err = run_face("train.py", [*run, "--vae", vae_dir, "--resume", "auto"], capsys)  # 4 channels at 8x
    assert code == 2 and err.count("\n") == 1
    assert "vae (the latent space)" in err and vae4x8 in err and vae_dir in err, err
    assert _files(tmp_path / "run") == before
    ckpt = str(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    code, _, err = run_face(
        "sample.py",
        ["--ckpt", ckpt, "--vae", _vae_4x(tmp_path / "vae4x4", 4), "--out", str(tmp_path / "g.png")],
        capsys,
    )
    assert code == 2 and err.count("\n") == 1 and "takes 8-channel latents, but VAE" in err and "makes 4" in err


def test_va_vae_by_name_is_priced_not_loaded():
    from dit.data.vae import load_vae
    from dit.io.errors import UserError

    assert vae_config_for("vavae") == vae_config_for("hustvl/vavae-imagenet256-f16d32-dinov2")
    assert vae_config_for("vavae")["latent_channels"] == 32
    with pytest.raises(UserError, match="LDM checkpoint, which diffusers does not load"):
        load_vae("vavae")
