"""REPA: the DiT's hidden tokens, the projector and its loss, the encoder's features (on the fly and stored with
the latents, both flips), their FLOPs against the meta-device count, resume, what ignores the projector, and bad
input. Encoders are timm's ``test_vit`` with random weights (``pretrained=False``) saved to a temp file."""

import json
import os

import pytest
import torch
from helpers import build_tiny_vae, make_image_folder, random_vit_weights, run_face, tiny_dit
from test_train import Pixels, tiny_config
from torch.utils.flop_counter import FlopCounterMode

from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.cost.analytic import (
    ViTShape,
    projector_forward_macs,
    repa_flops,
    training_flops_per_image,
    vit_forward_macs,
)
from dit.data.encoder import Encoder, create_encoder_model, encoder_shape, vit_shape
from dit.data.images import read_image, to_model_range
from dit.data.reader import LatentStoreDataset
from dit.data.store import read_header, shard_file
from dit.io.errors import UserError
from dit.model.projector import RepaProjector, repa_loss, resample_tokens
from dit.sample.loading import WeightsSection
from dit.train import TrainConfig, train

ENCODER = "test_vit"  # timm's 306k-parameter ViT: patch 16, width 64, depth 6


@pytest.fixture(scope="module")
def encoder_file(tmp_path_factory):
    return random_vit_weights(tmp_path_factory.mktemp("encoder") / "test_vit.safetensors")


def repa_config(tmp_path, encoder_file, **kw):
    base = dict(repa_encoder=ENCODER, repa_encoder_weights=encoder_file, repa_depth=1, repa_projector_dim=64)
    return tiny_config(tmp_path, **{**base, **kw})


def records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


# ---- the model's hidden tokens, the projector, the loss ---------------------------------------------------


@pytest.mark.parametrize("checkpointed", [0, 2])
def test_forward_returns_the_tokens_after_block_k(checkpointed):
    model = tiny_dit(0, depth=3).set_checkpointing(checkpointed).eval()  # eval: no random label dropout
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 2])
    plain = model(x, t, y)
    out, hidden = model(x, t, y, return_hidden_at=2)
    assert torch.equal(out, plain)
    tokens = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y, False)
    for block in model.blocks[:2]:
        tokens = block(tokens, c)
    torch.testing.assert_close(hidden, tokens)
    hidden.square().sum().backward()  # the tokens carry gradients back through the checkpointed blocks
    assert model.blocks[0].mlp.fc1.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="1..3"):
        model(x, t, y, return_hidden_at=4)


def test_loss_is_minus_the_cosine_averaged_over_tokens_and_grids_are_resampled():
    a = torch.randn(3, 16, 8)
    assert torch.allclose(repa_loss(a, 2.5 * a), torch.full((3,), -1.0))
    assert torch.allclose(repa_loss(a, -a), torch.ones(3))
    b = torch.randn(3, 16, 8)
    manual = -(torch.nn.functional.normalize(a, dim=-1) * torch.nn.functional.normalize(b, dim=-1)).sum(-1).mean(1)
    torch.testing.assert_close(repa_loss(a, b), manual)
    assert resample_tokens(a, 4) is a
    constant = torch.ones(2, 36, 5) * torch.arange(5.0)  # a 6x6 grid of one vector per channel
    assert torch.allclose(resample_tokens(constant, 4), torch.ones(2, 16, 5) * torch.arange(5.0))
    with pytest.raises(ValueError, match="square"):
        resample_tokens(torch.randn(1, 15, 2), 4)


# ---- FLOPs: analytic against FlopCounterMode on the meta device -------------------------------------------


@pytest.mark.parametrize(
    "name,size",
    [
        ("vit_base_patch14_dinov2.lvd142m", 224),  # REPA's; 46.3 GFLOP per image
        ("vit_small_patch14_reg4_dinov2.lvd142m", 98),  # four register tokens
        ("vit_medium_patch16_gap_256", 128),  # no class token
        ("vit_little_patch16_reg1_gap_256.sbb_in12k", 64),  # one register token, no class token
        (ENCODER, 64),
    ],
)
def test_encoder_forward_flops_equal_the_meta_count(name, size):
    model = create_encoder_model(name, "meta", size)
    x = torch.empty(2, model.patch_embed.proj.in_channels, size, size, device="meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.forward_features(x)
    shape = encoder_shape(name, size)
    assert 2 * vit_forward_macs(shape) * 2 == counter.get_total_flops()
    assert shape.grid == size // shape.patch_size


def test_gated_mlps_are_counted_as_three_matrices():
    from timm.layers import SwiGLUPacked
    from timm.models.vision_transformer import VisionTransformer

    with torch.device("meta"):
        model = VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=2, num_classes=0,
                                  mlp_layer=SwiGLUPacked, mlp_ratio=2.0)  # fmt: skip
    shape = vit_shape(model)
    assert shape.gated and shape.mlp_hidden == 48  # fc1 makes 2 x 48 (value and gate), fc2 reads 48
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.forward_features(torch.empty(1, 3, 32, 32, device="meta"))
    assert 2 * vit_forward_macs(shape) == counter.get_total_flops()


@pytest.mark.parametrize("model", ["DiT-XL/2", "DiT-B/2"])
def test_projector_training_flops_equal_the_meta_count(model):
    from dit.model.config import model_config

    cfg = model_config(model)
    with torch.device("meta"):
        projector = RepaProjector(cfg.hidden_size, 2048, 768)
        tokens = torch.empty(1, cfg.tokens, cfg.hidden_size, device="meta", requires_grad=True)  # the DiT's
    with FlopCounterMode(display=False) as counter:
        projector(tokens).sum().backward()
    dinov2 = ViTShape(depth=12, width=768, mlp_hidden=3072, patch_size=14, in_channels=3, input_size=224)
    flops = repa_flops(dinov2, cfg, 2048)
    assert flops.projector_train == counter.get_total_flops()
    assert flops.projector_forward == 2 * projector_forward_macs(cfg.hidden_size, 2048, 768, cfg.tokens)


def test_dit_cost_train_adds_repa_without_a_download(capsys, monkeypatch):
    from dit.cost.__main__ import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["train", "--repa-encoder", "vit_base_patch14_dinov2.lvd142m", "--model", "DiT-XL/2", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        encoder = create_encoder_model("vit_base_patch14_dinov2.lvd142m", "meta", 224)
        projector = RepaProjector(1152, 2048, 768)
        hidden = torch.empty(1, 256, 1152, device="meta", requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            encoder.forward_features(torch.empty(1, 3, 224, 224, device="meta"))
        projector(hidden).sum().backward()
    assert plan["repa_input_size"] == 224  # REPA's 16x16 patches, the XL/2 token grid
    assert plan["aux_gflops_per_image"] * 1e9 == pytest.approx(counter.get_total_flops(), rel=1e-12)
    assert plan["aux_share_of_dit"] == pytest.approx(plan["aux_gflops_per_image"] / plan["train_gflops_per_image"])
    assert main(argv + ["--repa-cached-features"]) == 0
    cached = json.loads(capsys.readouterr().out)
    assert cached["aux_gflops_per_image"] == pytest.approx(cached["repa_projector_train_gflops_per_image"])
    assert main(["train", "--repa-encoder", "vit_base_patch14_dinov2.lvd142m", "--model", "DiT-XL/2"]) == 0
    assert "REPA (auxiliary)" in capsys.readouterr().out


# ---- training ---------------------------------------------------------------------------------------------


def test_the_alignment_loss_trains_down_and_is_costed_apart(tmp_path, encoder_file):
    result = train(repa_config(tmp_path, encoder_file, max_steps=24, log_every=8, mfu_warmup_steps=0), Pixels())
    assert result["step"] == 24
    rows = records(tmp_path / "run")
    align = [r["repa_loss"] for r in rows]
    assert -1 <= align[-1] < align[0] - 0.05, align  # minus the cosine similarity falls
    saved = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    from dit.model.config import DiTConfig

    cfg = DiTConfig(**saved["model_config"])
    shape = encoder_shape(ENCODER, 64)  # the default: the DiT's 4x4 grid x patch 16
    aux = repa_flops(shape, cfg, 64)
    for r in rows:
        assert r["aux_tflops_per_image"] * 1e12 == pytest.approx(aux.projector_train + aux.encoder_forward)
        dit = training_flops_per_image(cfg).model
        assert r["mfu_with_aux"] == pytest.approx(r["mfu"] * (dit + r["aux_tflops_per_image"] * 1e12) / dit)
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "REPA encoder test_vit at 64 px (4x4 patches, 64 wide): forward only" in log
    assert "repa_loss=" in log


def test_resume_with_repa_is_bit_identical(tmp_path, encoder_file):
    straight = train(repa_config(tmp_path / "a", encoder_file, max_steps=6), Pixels())
    train(repa_config(tmp_path / "b", encoder_file, max_steps=3), Pixels())
    resumed = train(repa_config(tmp_path / "b", encoder_file, max_steps=6, resume="auto"), Pixels())
    assert straight["step"] == resumed["step"] == 6
    a = load_checkpoint(latest_checkpoint(tmp_path / "a" / "run" / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(tmp_path / "b" / "run" / "checkpoints"))
    for key in ("model", "ema", "repa_projector"):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
    assert any(k.startswith("projector.") for k in a["optimizer"]["state"])  # the projector trains
    for k, s in a["optimizer"]["state"].items():
        assert torch.equal(s["exp_avg_sq"], b["optimizer"]["state"][k]["exp_avg_sq"]), k
    assert torch.count_nonzero(a["repa_projector"]["4.weight"]) > 0
    # another REPA setting is not the same run
    with pytest.raises(UserError, match="repa_depth"):
        train(repa_config(tmp_path / "b", encoder_file, max_steps=8, repa_depth=2, resume="auto"), Pixels())


def test_sampling_and_init_from_ignore_the_projector(tmp_path, encoder_file):
    from dit.runtime import Runtime
    from dit.sample.generate import Guidance, Sampler, generate
    from dit.sample.loading import load_sampling_model

    # an encoder grid (2x2 at 32 px) other than the DiT's (4x4): the features are resampled in the step
    train(repa_config(tmp_path, encoder_file, max_steps=2, repa_input_size=32), Pixels())
    assert "test_vit at 32 px (2x2 patches" in (tmp_path / "run" / "log.txt").read_text()
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert "repa_projector" in load_checkpoint(ckpt)
    sm = load_sampling_model(str(ckpt))
    with Runtime("cpu") as rt:
        sampler = Sampler(sm, 2, "ddim", guidance=Guidance(2.0, 3))
        assert generate(sm, sampler, [0, 1], [0, 1], precision=rt.precision).shape == (2, 3, 8, 8)
    fine = tiny_config(tmp_path / "fine", max_steps=1, init_from=str(ckpt))  # a plain run from REPA weights
    train(fine, Pixels())
    report = json.loads((tmp_path / "fine" / "run" / "init_from.json").read_text())
    assert not any("projector" in name for name in report["loaded"])


# ---- the latent store with features -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory, encoder_file):
    """Images (32 px) -> tiny VAE latents + test_vit features of both flips, fp32 storage."""
    from helpers import face

    root = tmp_path_factory.mktemp("repa_store")
    vae_dir = root / "vae"
    build_tiny_vae(seed=0).save_pretrained(vae_dir)
    images = make_image_folder(root / "images", {"a_cat": 5, "b_dog": 4})
    out = root / "store"
    argv = ["--data-path", images, "--features-path", str(out), "--vae", str(vae_dir), "--image-size", "32",
            "--shard-size", "4", "--batch-size", "3", "--num-workers", "0", "--storage-dtype", "fp32",
            "--repa-encoder", ENCODER, "--repa-encoder-weights", encoder_file]  # fmt: skip
    assert face("extract_features.py").main(argv) == 0
    return {"out": str(out), "images": images, "vae": str(vae_dir)}


def test_stored_features_equal_recomputed_ones_for_both_flips(store, encoder_file):
    manifest = json.loads((open(os.path.join(store["out"], "manifest.json"))).read())
    feats = manifest["features"]
    assert (feats["encoder"], feats["input_size"], feats["tokens"], feats["dim"]) == (ENCODER, 32, 4, 64)
    encoder = Encoder(ENCODER, encoder_file, 32)
    assert feats["forward_flops"] == 2 * vit_forward_macs(encoder.shape)
    header, _ = read_header(os.path.join(store["out"], shard_file(0)))
    names = json.loads(header["__metadata__"]["dit_ledger"])["files"]
    from safetensors.torch import load_file

    stored = load_file(os.path.join(store["out"], shard_file(0)))["features"]
    assert stored.shape == (len(names), 2, 4, 64)
    x = torch.cat([to_model_range(read_image(os.path.join(store["images"], n), 32))[None] for n in names])
    torch.testing.assert_close(stored[:, 0], encoder.features(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stored[:, 1], encoder.features(x.flip(-1)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(stored[:, 0], stored[:, 1], atol=1e-3)  # the flip changes them

    # the reader hands out the features of the same view as the latent
    data = LatentStoreDataset(store["out"], sample_posterior=False, features=True)
    moments = load_file(os.path.join(store["out"], shard_file(0)))["moments"]
    torch.manual_seed(0)
    views = set()
    for latent, _, features in data.__getitems__([0] * 16):
        v = 0 if torch.allclose(latent, moments[0, 0, 0] * data.scale) else 1
        assert torch.allclose(latent, moments[0, v, 0] * data.scale)
        assert torch.equal(features, stored[0, v])
        views.add(v)
    assert views == {0, 1}


def test_training_on_stored_features_runs_no_encoder_and_says_so(store, encoder_file, tmp_path):
    from dit.runtime import Runtime
    from dit.sample.export import export_checkpoint
    from dit.train import Trainer

    common = dict(model="DiT-S/2", depth=2, hidden_size=32, num_heads=2, image_size=32, num_classes=3,
                  feature_path=store["out"], global_batch_size=4, precision="fp32", num_workers=0,
                  peak_tflops=0.05, repa_encoder=ENCODER, repa_input_size=32, repa_depth=1, repa_projector_dim=32)  # fmt: skip
    cfg = TrainConfig.of(**common, max_steps=4, log_every=2, results_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, Runtime("cpu"))
    assert trainer.repa.cached and trainer.repa.encoder is None
    extraction = trainer.repa.flops.encoder_forward * 2 * 9  # both views of 9 images
    record = trainer.ledger.log_eval(0, {"fid": 1.0})
    assert (
        record["feature_extraction_pflops"] * 1e15 == pytest.approx(extraction) and record["total_aux_pflops"] == 0
    )
    trainer.run()
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "paid once, at extraction" in log and "x 2 view(s) x 9 images" in log
    rows = records(tmp_path / "run")
    assert all(r["aux_tflops_per_image"] * 1e12 == pytest.approx(trainer.repa.flops.projector_train) for r in rows)
    # export and sampling read the model alone
    ckpt = str(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    exported = export_checkpoint(WeightsSection(ckpt=ckpt, vae=store["vae"]), str(tmp_path / "pipe"))
    assert (tmp_path / "pipe" / "transformer").is_dir() and exported["weights"] == "ema"
    # another encoder or input size than the store's features is refused, in one line
    for change, match in (
        ({"repa_input_size": 64}, "made by test_vit at 32 px"),
        ({"repa_encoder": "test_vit2"}, "made by"),
    ):
        bad = TrainConfig.of(**{**common, **change}, max_steps=4, results_dir=str(tmp_path / "bad"))
        with pytest.raises(UserError, match=match) as e:
            Trainer(bad, Runtime("cpu"))
        assert "\n" not in str(e.value)


def test_stores_without_features_or_flips_are_refused(tmp_path):
    from dit.data.store import write_moments_store
    from dit.extract import ExtractConfig, extract_features
    from dit.model.repa_config import RepaEncoderSection

    with pytest.raises(UserError, match="drop --no-flip"):
        extract_features(ExtractConfig(feature_path=str(tmp_path / "s"), flip=False), RepaEncoderSection(ENCODER))
    moments = torch.randn(8, 2, 2, 4, 4, 4)
    write_moments_store(str(tmp_path / "plain"), moments, torch.arange(8) % 2, num_classes=2)
    with pytest.raises(UserError, match="holds no encoder features"):
        LatentStoreDataset(str(tmp_path / "plain"), features=True)
    identity = {"encoder": ENCODER, "input_size": 32, "weights": "x", "tokens": 4, "dim": 8}
    write_moments_store(str(tmp_path / "one"), moments[:, :1], torch.arange(8) % 2, num_classes=2,
                        features=torch.randn(8, 1, 4, 8), encoder=identity)  # fmt: skip
    with pytest.raises(UserError, match="without --no-flip"):
        LatentStoreDataset(str(tmp_path / "one"), features=True)
    assert len(LatentStoreDataset(str(tmp_path / "one"), flip=False, features=True)[0]) == 3


# ---- bad input: one line each ------------------------------------------------------------------------------


def test_bad_repa_input_is_one_error_line(tmp_path, encoder_file, capsys):
    images = make_image_folder(tmp_path / "images", {"a": 8, "b": 8})
    base = ["--data-path", images, "--vae", "none", "--model", "DiT-S/2", "--depth", "2", "--hidden-size", "32",
            "--num-heads", "2", "--image-size", "8", "--num-classes", "3", "--global-batch-size", "8",
            "--max-steps", "1", "--precision", "fp32", "--num-workers", "0", "--repa-depth", "1"]  # fmt: skip
    cases = [
        (
            ["--repa-encoder", ENCODER, "--repa-encoder-weights", str(tmp_path / "missing.pth")],
            "--repa-encoder-weights",
        ),
        (["--repa-encoder", "no_such_vit", "--repa-encoder-weights", encoder_file], "neither a timm model"),
        (
            ["--repa-encoder", ENCODER, "--repa-encoder-weights", encoder_file, "--repa-depth", "3"],
            "--repa-depth 3",
        ),
        (["--repa-encoder", "resnet18", "--repa-encoder-weights", encoder_file], "not a timm VisionTransformer"),
        (
            ["--repa-encoder", ENCODER, "--repa-encoder-weights", encoder_file, "--repa-input-size", "40"],
            "multiple of",
        ),
    ]
    for i, (extra, match) in enumerate(cases):
        code, out, err = run_face("train.py", [*base, "--results-dir", str(tmp_path / f"r{i}"), *extra], capsys)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code != 0 and len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], (extra, err)


@pytest.mark.slow
def test_ddp_and_fsdp_with_repa_match_one_process(tmp_path, encoder_file):
    """train.py under torchrun, 2 processes: DDP (with activation checkpointing) and FSDP train the DiT and the
    projector to the one-process weights, and the FSDP checkpoint holds both whole."""
    import subprocess
    import sys

    from helpers import ROOT

    images = make_image_folder(tmp_path / "images", {"a": 8, "b": 8})
    os.remove(os.path.join(images, "a", "broken.jpg"))  # make_image_folder's undecodable file
    base = ["train.py", "--data-path", images, "--vae", "none", "--model", "DiT-S/2", "--depth", "2",
            "--hidden-size", "32", "--num-heads", "2", "--image-size", "8", "--num-classes", "3",
            "--global-batch-size", "8", "--max-steps", "3", "--precision", "fp32", "--num-workers", "0",
            "--log-every", "1", "--lr", "1e-3", "--peak-tflops", "0.05", "--repa-encoder", ENCODER,
            "--repa-encoder-weights", encoder_file, "--repa-depth", "1", "--repa-projector-dim", "32"]  # fmt: skip
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    runs = {
        "one": base,
        "ddp": [*torchrun, *base, "--activation-checkpointing", "all"],
        "fsdp": [*torchrun, *base, "--fsdp"],
    }
    ckpts = {}
    for name, args in runs.items():
        proc = subprocess.run([sys.executable, *args, "--results-dir", str(tmp_path / name)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        ckpts[name] = load_checkpoint(latest_checkpoint(tmp_path / name / "checkpoints"))
    one = ckpts["one"]
    assert torch.count_nonzero(one["model"]["final_layer.linear.weight"]) > 0
    for name in ("ddp", "fsdp"):
        for part in ("model", "repa_projector"):
            assert one[part].keys() == ckpts[name][part].keys()
            for k in one[part]:
                torch.testing.assert_close(ckpts[name][part][k], one[part][k], rtol=1e-4, atol=1e-5, msg=(name, k))
        assert one["optimizer"]["state"].keys() == ckpts[name]["optimizer"]["state"].keys()
    rows = {n: [json.loads(x)["repa_loss"] for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
            for n in runs}  # fmt: skip
    assert rows["ddp"] == pytest.approx(rows["one"], rel=1e-4) and rows["fsdp"] == pytest.approx(
        rows["one"], rel=1e-4
    )


def test_a_grey_image_is_repeated_for_a_colour_encoder(encoder_file):
    encoder = Encoder(ENCODER, encoder_file, 32)
    grey = torch.rand(2, 1, 20, 20) * 2 - 1  # and resized to the input size
    torch.testing.assert_close(encoder.features(grey), encoder.features(grey.expand(-1, 3, -1, -1)))
    with pytest.raises(UserError, match="3-channel images"):
        encoder.features(torch.zeros(1, 2, 32, 32))


# ---- the digit encoder: ours, not the judge ----------------------------------------------------------------


def test_digits_mae_loads_by_name_with_its_report():
    from safetensors.torch import load_file

    from dit.data.encoder import LOCAL_ENCODERS
    from dit.data.store import sha256_file

    local = LOCAL_ENCODERS["digits-mae"]
    report = json.loads(local.report.read_text())
    assert report["sha256"] == sha256_file(local.weights) and report["labels_used"].startswith("none in training")
    encoder = Encoder("digits-mae", None, 28)
    assert encoder.weights_id == f"sha256:{report['sha256']}" and (encoder.grid, encoder.dim) == (7, 128)
    saved = load_file(local.weights)
    assert all(torch.equal(v, saved[k]) for k, v in encoder.model.state_dict().items())
    assert encoder.upstream_flops == report["train_flops"]
    assert report["train_flops"] == report["train_flops_per_image"] * report["train_images"] * report["epochs"]
    assert report["encoder_forward_flops_per_image"] == 2 * vit_forward_macs(encoder.shape)
    digits = torch.rand(3, 1, 28, 28) * 2 - 1
    assert encoder.features(digits).shape == (3, 49, 128)
    # the classifier behind the digit FID is another network
    from dit.eval.digit_nets import DIGIT_WEIGHTS

    assert sha256_file(DIGIT_WEIGHTS) != report["sha256"]


@pytest.mark.slow
def test_the_quick_start_model_trains_with_digits_mae(tmp_path):
    from dit.data.digits import DigitDataset
    from dit.train.recipes import PRESETS, digits_train_config

    cfg = digits_train_config(PRESETS["default"], 4, tmp_path / "run", "cpu")
    cfg = cfg.replace(repa_encoder="digits-mae", repa_depth=2, log_every=2, progress=False, peak_tflops=0.05)
    train(cfg, DigitDataset(28))
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "REPA encoder digits-mae at 28 px (7x7 patches, 128 wide)" in log and "was itself trained with" in log
    assert all(r["repa_loss"] > -1 for r in records(tmp_path / "run"))


@pytest.mark.slow
def test_the_digit_encoder_script_is_deterministic(tmp_path):
    from helpers import face

    script = face("studies/train_digit_encoder.py")
    for name in ("a", "b"):
        assert script.main(["--epochs", "1", "--out", str(tmp_path / f"{name}.safetensors")]) == 0
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b"))
    assert a["sha256"] == b["sha256"] and a["train_flops"] == b["train_flops"] > 0
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_with_images_encoded_on_the_fly_the_encoder_sees_the_pixels(tmp_path, encoder_file, monkeypatch):
    """The step's hooks run in order: REPA's targets come from the image before the VAE encodes it."""
    from dit.train.repa import Repa

    images = make_image_folder(tmp_path / "images", {"cat": 5, "dog": 5})
    os.remove(os.path.join(images, "cat", "broken.jpg"))
    build_tiny_vae(seed=0).save_pretrained(tmp_path / "vae")
    seen, targets = [], Repa.targets
    monkeypatch.setattr(
        Repa, "targets", lambda self, x, stored: seen.append(tuple(x.shape)) or targets(self, x, stored)
    )
    cfg = dict(data_path=images, vae=str(tmp_path / "vae"), image_size=32, num_classes=3, max_steps=2)
    assert train(repa_config(tmp_path, encoder_file, **cfg))["step"] == 2
    assert seen and all(shape[1:] == (3, 32, 32) for shape in seen), seen  # pixels, not 4x4 latents
