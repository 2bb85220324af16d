"""train.py on its data sources: a latent store, and an image folder encoded by a VAE on the fly."""

import json
import os

import pytest
import torch
from test_train import tiny_config

from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.data.store import write_moments_store
from dit.io.errors import UserError
from dit.train import train


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store")
    g = torch.Generator().manual_seed(0)
    moments = torch.randn(24, 2, 2, 4, 4, 4, generator=g)  # [N, views, (mean, logvar), C, H, W]
    moments[:, :, 1] = -4.0  # small posterior variance
    write_moments_store(str(folder), moments, torch.arange(24) % 3, num_classes=3)
    return folder


def config(store, out, **kw):
    """The trainer tests' tiny model on the store: 4x4 latents of 32 px images, 3 classes."""
    store_kw = dict(image_size=32, num_classes=3, feature_path=str(store), vae="ema", max_steps=4, lr=1e-4)
    return tiny_config(out, **{**store_kw, "results_dir": str(out), **kw})


def test_trains_on_the_store(store, tmp_path):
    result = train(config(store, tmp_path / "run"))
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "VAE encode: cost unknown ('in-memory moments'" in log  # this store does not say which VAE made it
    assert result["step"] == 4
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert ckpt["model_config"]["in_channels"] == 4 and ckpt["model_config"]["input_size"] == 4
    assert torch.count_nonzero(ckpt["model"]["final_layer.linear.weight"]) > 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]


def test_store_that_does_not_fit_the_model_is_refused(store, tmp_path):
    with pytest.raises(UserError, match="--num-classes 3"):
        train(config(store, tmp_path / "a", num_classes=5))
    with pytest.raises(UserError, match="--image-size 32"):
        train(config(store, tmp_path / "b", image_size=64))


def test_trains_on_images_encoded_on_the_fly(tmp_path, vae_dir):
    from helpers import make_image_folder

    images = make_image_folder(tmp_path / "images", {"cat": 5, "dog": 5})
    os.remove(os.path.join(images, "cat", "broken.jpg"))
    cfg = config(
        None, tmp_path / "run", feature_path=None, data_path=images, vae=vae_dir, image_size=32, num_classes=3
    )
    train(cfg)
    ckpt = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert ckpt["config"]["data"]["vae"] == vae_dir  # the sampler decodes with the run's own VAE
    # The encoder runs inside the step: its FLOPs are counted, and MFU is given with and without them.
    from dit.cost.analytic import training_flops_per_image, vae_flops
    from dit.data.vae import load_vae
    from dit.model.config import DiTConfig

    encode = vae_flops(dict(load_vae(vae_dir).config), 32).encode
    model = training_flops_per_image(DiTConfig(**ckpt["model_config"])).model
    assert "VAE encode on the fly" in (tmp_path / "run" / "log.txt").read_text()
    for r in [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]:
        assert r["vae_tflops_per_image"] == pytest.approx(encode / 1e12)
        rate, peak = r["images_per_sec_per_device"], r["peak_tflops"] * 1e12
        assert r["mfu"] == pytest.approx(rate * model / peak, rel=1e-9)
        assert r["mfu_with_vae"] == pytest.approx(rate * (model + encode) / peak, rel=1e-9)
    assert (ckpt["model_config"]["in_channels"], ckpt["model_config"]["input_size"]) == (4, 4)
    assert torch.count_nonzero(ckpt["model"]["final_layer.linear.weight"]) > 0


def test_an_unreadable_image_names_the_file_and_keeps_the_work(tmp_path, vae_dir):
    from helpers import make_image_folder

    images = make_image_folder(tmp_path / "images", {"cat": 5, "dog": 5})  # with cat/broken.jpg
    cfg = config(
        None, tmp_path / "run", feature_path=None, data_path=images, vae=vae_dir, image_size=32, num_classes=3,
        max_steps=8,
    )  # fmt: skip
    with pytest.raises(UserError, match="broken.jpg") as err:
        train(cfg)
    assert "\n" not in str(err.value)  # one line, also from a data-loader worker (tests/test_faults.py)
    saved = latest_checkpoint(tmp_path / "run" / "checkpoints")
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "skipped 2 unusable entries" in log and "notes.txt (not an image file)" in log
    # the work done before the bad batch is kept (a run stopped before its first step writes nothing)
    assert saved is None or 0 < load_checkpoint(saved)["step"] < 8


def test_a_store_reports_the_encode_it_paid_once(tmp_path):
    from dit.cost.analytic import vae_flops
    from dit.cost.vae_facts import SD_VAE_CONFIG

    g = torch.Generator().manual_seed(0)
    moments = torch.randn(16, 2, 2, 4, 4, 4, generator=g).abs()
    folder = tmp_path / "sd-store"
    write_moments_store(str(folder), moments, torch.arange(16) % 3, num_classes=3, vae_config=SD_VAE_CONFIG)
    train(config(folder, tmp_path / "run", max_steps=2))
    log = (tmp_path / "run" / "log.txt").read_text()
    gflops = vae_flops(SD_VAE_CONFIG, 32).encode / 1e9
    assert f"paid once, at extraction: {gflops:.4g} GFLOP per image x 2 view(s) x 16 images" in log
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["vae_tflops_per_image"] == 0 and r["mfu_with_vae"] == r["mfu"] for r in rows)  # not in this run


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_vae_encodes_in_the_runs_precision(tmp_path, vae_dir, precision, dtype):
    """The frozen VAE runs under the run's autocast (273 GFLOP an SD image: in IEEE fp32 it outweighed a bf16
    DiT step); its latents reach the DiT in float32 either way."""
    from helpers import make_image_folder

    from dit.runtime import Runtime
    from dit.train import Trainer

    images = make_image_folder(tmp_path / "images", {"cat": 4, "dog": 4})
    os.remove(os.path.join(images, "cat", "broken.jpg"))
    cfg = config(
        None, tmp_path / "run", feature_path=None, data_path=images, vae=vae_dir, image_size=32, num_classes=3,
        precision=precision, global_batch_size=4, log_every=1000,
    )  # fmt: skip
    with Runtime("cpu", precision) as runtime:
        trainer = Trainer(cfg, runtime, None)
        seen = []
        conv = trainer.data.vae.encoder.conv_in.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        model = trainer.state.model.x_embedder.register_forward_pre_hook(lambda m, i: seen.append(i[0].dtype))
        trainer.train_step([next(iter(trainer.loader))], log_step=False)
        conv.remove(), model.remove()
        trainer.lock.release()
    assert seen == [dtype, torch.float32]
