"""Fine-tuning and the official workflow: --init-from released weights, models read from their shapes, the
official commands' flags, VAEs with a shift and 16 channels, unconditional models."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_vae, make_image_folder, randomize, run_face
from test_train import Pixels, tiny_config

from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.io.errors import UserError
from dit.model.config import model_config, model_config_from_shapes, model_names
from dit.model.dit import DiT_models
from dit.runtime import Runtime
from dit.train import TrainConfig, Trainer, train

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def official_s2(tmp_path_factory) -> Path:
    """An official-format release: a bare state dict of DiT-S/2 (random weights) for 64 px images, 1000 classes."""
    path = tmp_path_factory.mktemp("release") / "DiT-S-2-64.pt"
    torch.save(randomize(DiT_models["DiT-S/2"](input_size=8, num_classes=1000), seed=4).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def four_classes(tmp_path_factory) -> str:
    folder = make_image_folder(tmp_path_factory.mktemp("images"), {c: 3 for c in "abcd"})
    for junk in ("broken.jpg", "notes.txt"):
        (Path(folder) / "a" / junk).unlink()
    (Path(folder) / "c_empty").rmdir()
    return folder


def finetune_config(out, data, vae, weights, **kw) -> TrainConfig:
    base = dict(model="DiT-S/2", image_size=64, num_classes=4, data_path=data, vae=vae, init_from=str(weights),
                global_batch_size=4, max_steps=2, lr=1e-4, precision="fp32", num_workers=0, log_every=1,
                results_dir=str(out), peak_tflops=0.05, keep_last=0)  # fmt: skip
    return TrainConfig.of(**{**base, **kw})


def test_finetune_an_official_release_to_new_classes_trains_samples_and_resumes(
    official_s2, four_classes, vae_dir, tmp_path, capsys
):
    source = torch.load(official_s2, weights_only=True)
    cfg = finetune_config(tmp_path / "run", four_classes, vae_dir, official_s2)
    trainer = Trainer(cfg, Runtime("cpu"), None)
    model = trainer.state.model.state_dict()
    for name, value in source.items():
        if name != "y_embedder.embedding_table.weight":
            assert torch.equal(model[name], value), name
    table = model["y_embedder.embedding_table.weight"]
    assert table.shape == (5, 384) and torch.equal(table[4], source["y_embedder.embedding_table.weight"][1000])
    ema = trainer.state.ema.model.state_dict()
    assert all(torch.equal(ema[k], v) for k, v in model.items())  # the EMA starts from the loaded weights
    trainer.run()
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "initialised from" in log and "(1001, 384) -> (5, 384) (null row kept)" in log
    listing = json.loads((tmp_path / "run" / "init_from.json").read_text())
    assert len(listing["loaded"]) == len(source) - 1 and listing["weights"] == "state_dict"

    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    code, out, err = run_face("sample.py", ["--ckpt", str(ckpt), "--num-sampling-steps", "2", "--precision", "fp32",
                                            "--peak-tflops", "1", "--out", str(tmp_path / "g.png")], capsys)  # fmt: skip
    assert code == 0, err

    # it resumes exactly: 2 + 2 steps equal 4 straight
    train(finetune_config(tmp_path / "straight", four_classes, vae_dir, official_s2, max_steps=4))
    train(
        finetune_config(tmp_path / "run", four_classes, vae_dir, None, init_from=None, resume="auto", max_steps=4)
    )
    a = load_checkpoint(latest_checkpoint(tmp_path / "straight" / "checkpoints"))["model"]
    b = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_another_input_size_recomputes_the_position_table(official_s2, four_classes, vae_dir, tmp_path):
    cfg = finetune_config(tmp_path / "run", four_classes, vae_dir, official_s2, image_size=128)
    trainer = Trainer(cfg, Runtime("cpu"), None)
    fresh = DiT_models["DiT-S/2"](input_size=16, num_classes=4)
    assert torch.equal(trainer.state.model.pos_embed, fresh.pos_embed)  # the 8x8 grid's formula for 16x16
    assert "pos_embed (1, 16, 384) -> (1, 64, 384)" in (tmp_path / "run" / "log.txt").read_text()


def test_init_from_refuses_what_it_cannot_adapt(official_s2, four_classes, vae_dir, tmp_path):
    with pytest.raises(UserError, match=r"hidden|blocks\.0\.attn\.qkv\.weight: \(1152, 384\)"):
        train(finetune_config(tmp_path / "a", four_classes, vae_dir, official_s2, model="DiT-B/2"))
    with pytest.raises(UserError, match="--init-from starts a new run"):
        finetune_config(tmp_path / "b", four_classes, vae_dir, official_s2, resume="auto")


@pytest.mark.parametrize("name", model_names())
def test_a_bare_state_dict_says_which_model_it_is(name):
    with torch.device("meta"):
        model = DiT_models[name](input_size=32, num_classes=1000)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert model_config_from_shapes(shapes) == model.config


@pytest.mark.parametrize("size,heads", [("S", 12), ("L", 8), ("XL", 12)])
def test_swiglu_and_qk_norm_are_read_from_the_keys_rmsnorm_and_rope_are_not(size, heads):
    """QK-norm's weights also give the head count (here not the registry's)."""
    with torch.device("meta"):
        model = DiT_models[f"DiT-{size}/2"](mlp="swiglu", qk_norm=True, num_heads=heads, norm="rmsnorm", rope=True)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    read = model_config_from_shapes(shapes)
    assert (read.mlp, read.qk_norm, read.num_heads) == ("swiglu", True, heads)
    assert read.mlp_hidden == model.config.mlp_hidden
    assert read == dataclasses.replace(model.config, norm="layernorm", rope=False)  # no keys: from the config
    shapes["blocks.0.mlp.w3.weight"] = (shapes["blocks.0.mlp.w3.weight"][0], 1001)
    with pytest.raises(UserError, match="SwiGLU MLP is 1001 wide"):
        model_config_from_shapes(shapes)


def test_sampling_a_release_needs_no_model_flag_and_checks_one(tmp_path, vae_dir, capsys):
    path = tmp_path / "bare.pt"
    torch.save(randomize(DiT_models["DiT-S/8"](input_size=8, num_classes=10), seed=1).state_dict(), path)
    common = ["--ckpt", str(path), "--vae", vae_dir, "--num-sampling-steps", "2", "--precision", "fp32",
              "--peak-tflops", "1", "--class-labels", "3", "--out", str(tmp_path / "g.png")]  # fmt: skip
    code, out, err = run_face("sample.py", common, capsys)
    assert code == 0, err
    code, _, err = run_face("sample.py", [*common, "--model", "DiT-B/8"], capsys)
    assert code == 2 and "--model DiT-B/8 does not match the checkpoint, whose weights are DiT-S/8" in err


def test_an_official_release_name_is_downloaded_or_the_error_says_where_to_put_it(tmp_path, monkeypatch):
    from dit import checkpoint

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))

    def offline(url, dst, progress=True):
        raise OSError("Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(UserError) as err:
        checkpoint.load_checkpoint("DiT-XL-2-256x256.pt")
    where = tmp_path / "hub" / "checkpoints" / "DiT-XL-2-256x256.pt"
    assert "https://dl.fbaipublicfiles.com/DiT/models/DiT-XL-2-256x256.pt" in str(err.value) and str(where) in str(
        err.value
    )

    def fake(url, dst, progress=True):  # the download path: a file appears, then it loads like any other
        torch.save({"w": torch.ones(1)}, dst)

    monkeypatch.setattr(torch.hub, "download_url_to_file", fake)
    assert torch.equal(checkpoint.load_checkpoint("DiT-XL-2-256x256.pt")["w"], torch.ones(1)) and where.is_file()


# The official scripts' command lines, flag for flag (facebookresearch/DiT README and their argparse flags).
OFFICIAL = {
    "train.py": "--model DiT-XL/2 --data-path /data/imagenet/train --results-dir results --image-size 256 "
    "--num-classes 1000 --epochs 1400 --global-batch-size 256 --global-seed 0 --vae ema --num-workers 4 "
    "--log-every 100 --ckpt-every 50000",
    "sample.py": "--model DiT-XL/2 --vae mse --image-size 512 --num-classes 1000 --cfg-scale 4.0 "
    "--num-sampling-steps 250 --seed 1 --ckpt DiT-XL-2-512x512.pt",
    "scripts/sample_ddp.py": "--model DiT-XL/2 --vae ema --sample-dir samples --per-proc-batch-size 32 "
    "--num-fid-samples 50000 --image-size 256 --num-classes 1000 --cfg-scale 1.5 --num-sampling-steps 250 "
    "--global-seed 0 --no-tf32 --ckpt DiT-XL-2-256x256.pt",
}


def test_the_official_command_lines_parse_with_the_same_meaning():
    from dit.sample.config import parse_fid_config, parse_sample_config
    from dit.train import parse_train_config

    t = parse_train_config(shlex.split(OFFICIAL["train.py"]))
    assert (t.optim.seed, t.budget.epochs, t.data.vae, t.checkpoint.ckpt_every) == (0, 1400, "ema", 50000)
    s = parse_sample_config(shlex.split(OFFICIAL["sample.py"]))
    assert (s.sampling.guidance_scale, s.grid.seed, s.weights.image_size, s.runtime.precision) == (
        4.0,
        1,
        512,
        "tf32",
    )
    f = parse_fid_config(shlex.split(OFFICIAL["scripts/sample_ddp.py"]))
    assert (f.fid.seed, f.fid.num_fid_samples, f.fid.batch_size, f.runtime.precision) == (0, 50000, 32, "fp32")
    assert f.fid.sample_dir == "samples" and t.checkpoint.results_dir == "results"
    assert parse_fid_config(["--tf32"]).runtime.precision == "tf32"


def test_epochs_become_steps_and_the_conversion_is_logged(tmp_path):
    result = train(tiny_config(tmp_path, epochs=2, max_steps=1000), Pixels())  # 32 items / 8 a batch = 4 a pass
    assert result["step"] == 8
    assert "--epochs 2 = 2 x 4 steps of 8 images = --max-steps 8" in (tmp_path / "run" / "log.txt").read_text()


def test_a_16_channel_shifted_vae_extracts_trains_samples_and_is_costed(tmp_path, capsys):
    from dit.cost.__main__ import main as dit_cost
    from dit.extract import ExtractConfig, extract_features

    vae = build_tiny_vae(latent_channels=16)
    vae.register_to_config(shift_factor=0.1, scaling_factor=1.5)
    vae.save_pretrained(tmp_path / "vae16")
    images = make_image_folder(tmp_path / "images", {"a": 4, "b": 4})
    (Path(images) / "a" / "broken.jpg").unlink()
    store = tmp_path / "store"
    extract_features(ExtractConfig(feature_path=str(store), data_path=images, image_size=32,
                                   vae=str(tmp_path / "vae16"), num_workers=0))  # fmt: skip
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["shift_factor"] == pytest.approx(0.1) and manifest["latent_shape"] == [16, 4, 4]
    for source in (dict(feature_path=str(store)), dict(data_path=images, vae=str(tmp_path / "vae16"))):
        out = tmp_path / ("run_store" if "feature_path" in source else "run_fly")
        train(tiny_config(out, image_size=32, num_classes=3, global_batch_size=4, max_steps=2, **source))
        ckpt = load_checkpoint(latest_checkpoint(out / "run" / "checkpoints"))
        assert ckpt["model_config"]["in_channels"] == 16
    code, _, err = run_face("sample.py", ["--ckpt", str(latest_checkpoint(tmp_path / "run_fly" / "run" / "checkpoints")),
                                          "--num-sampling-steps", "2", "--precision", "fp32", "--peak-tflops", "1",
                                          "--out", str(tmp_path / "g.png")], capsys)  # fmt: skip
    assert code == 0, err
    assert (
        dit_cost(["flops", "--model", "DiT-S/2", "--image-size", "32", "--vae", str(tmp_path / "vae16"), "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["in_channels"] == 16


def test_an_unconditional_model_trains_samples_and_is_costed(tmp_path, capsys):
    from dit.cost.__main__ import main as dit_cost

    train(tiny_config(tmp_path, num_classes=0, max_steps=2), Pixels())
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    weights = load_checkpoint(ckpt)["ema"]
    assert not any(k.startswith("y_embedder") for k in weights)  # no label table at all
    argv = ["--ckpt", str(ckpt), "--num-sampling-steps", "2", "--precision", "fp32", "--peak-tflops", "1",
            "--out", str(tmp_path / "g.png")]  # fmt: skip
    code, out, err = run_face("sample.py", [*argv, "--guidance-scale", "1"], capsys)
    assert code == 0, err
    code, _, err = run_face("sample.py", argv, capsys)  # the default guidance of a model without a null class: 1
    assert code == 0, err
    code, _, err = run_face("sample.py", [*argv, "--guidance-scale", "4"], capsys)  # nothing to guide against
    assert code == 2 and "unconditional" in err
    assert dit_cost(["flops", "--model", "DiT-S/2", "--num-classes", "0", "--json"]) == 0
    uncond = json.loads(capsys.readouterr().out)
    cond = model_config("DiT-S/2", input_size=32)
    assert (
        uncond["params"]
        == sum(p.numel() for p in DiT_models["DiT-S/2"](input_size=32).parameters()) - 1001 * cond.hidden_size
    )
