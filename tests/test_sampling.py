"""sample.py and dit.sample: checkpoints of every kind sample, guidance and samplers, cost, bad input.

Tiny random DiTs (weights redrawn so that the adaLN-Zero model does not output zeros) and the tiny random
AutoencoderKL saved to a temp folder; 64 px images (8x8 latents), 10 sampling steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_tiny_vae, randomize, run_face, tiny_dit, write_our_checkpoint
from PIL import Image

from dit.cost.analytic import sampling_flops_per_image, vae_flops
from dit.data.images import to_uint8
from dit.io.errors import UserError
from dit.model.dit import DiT, DiT_models
from dit.runtime import Runtime
from dit.sample.config import SampleConfig
from dit.sample.fid_set import batches
from dit.sample.generate import Guidance, Sampler, generate, noise_seed
from dit.sample.grid import run_sample
from dit.sample.labels import fid_label
from dit.sample.loading import load_sampling_model

STEPS = "10"


@pytest.fixture(scope="module")
def official_files(tmp_path_factory) -> dict[str, Path]:
    """A bare state dict in the official layout (DiT-S/8 at 64 px, 10 classes) and an official train.py file."""
    folder = tmp_path_factory.mktemp("official")
    sd = randomize(DiT_models["DiT-S/8"](input_size=8, num_classes=10), seed=3).state_dict()
    torch.save(sd, folder / "bare.pt")
    args = argparse.Namespace(model="DiT-S/8", image_size=64, num_classes=10, vae="ema", global_seed=0)
    torch.save({"model": sd, "ema": sd, "opt": {}, "args": args}, folder / "train.pt")
    return {"bare": folder / "bare.pt", "train": folder / "train.pt"}


def sample_args(ckpt, out, *extra) -> list[str]:
    return [
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
        "--num-sampling-steps",
        STEPS,
        "--precision",
        "fp32",
        "--peak-tflops",
        "1",
    ] + [str(e) for e in extra]


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


# ---- checkpoints of every kind ----------------------------------------------------------------------------


def test_training_checkpoint_samples_a_grid_reproducibly(our_ckpt, tmp_path, capsys):
    args = ["--class-labels", 1, 2, 3, 4, 5, "--cfg-scale", 4]
    code, out, err = run_face("sample.py", sample_args(our_ckpt, tmp_path / "a.png", *args, "--seed", 7), capsys)
    assert code == 0, err
    assert "ema weights" in out and "TFLOP/image" in out and "MFU" in out
    run_face("sample.py", sample_args(our_ckpt, tmp_path / "b.png", *args, "--seed", 7), capsys)
    run_face("sample.py", sample_args(our_ckpt, tmp_path / "c.png", *args, "--seed", 8), capsys)
    a, b, c = pixels(tmp_path / "a.png"), pixels(tmp_path / "b.png"), pixels(tmp_path / "c.png")
    # 5 images of 64 px, 4 per row with torchvision's 2 px padding: 2 rows x 4 columns.
    assert a.shape == (2 * 66 + 2, 4 * 66 + 2, 3)
    assert np.array_equal(a, b), "the same seed must give the same grid"
    assert not np.array_equal(a, c), "another seed must give another grid"


def test_no_ema_samples_the_raw_weights(our_ckpt, tmp_path):
    common = dict(
        ckpt=str(our_ckpt), num_sampling_steps=int(STEPS), class_labels=[1, 2], precision="fp32", peak_tflops=1.0
    )
    ema = run_sample(SampleConfig.of(**common, out=str(tmp_path / "ema.png"), progress=False), Runtime("cpu"))
    raw = run_sample(
        SampleConfig.of(**common, out=str(tmp_path / "raw.png"), ema=False, progress=False), Runtime("cpu")
    )
    assert (ema.weights, raw.weights) == ("ema", "model")
    assert not np.array_equal(pixels(ema.path), pixels(raw.path))


def test_official_bare_state_dict_samples(official_files, vae_dir, tmp_path, capsys):
    flags = [
        "--model",
        "DiT-S/8",
        "--image-size",
        64,
        "--num-classes",
        10,
        "--vae",
        vae_dir,
        "--class-labels",
        0,
        9,
    ]
    code, out, err = run_face("sample.py", sample_args(official_files["bare"], tmp_path / "g.png", *flags), capsys)
    assert code == 0, err
    assert "state_dict weights" in out
    assert pixels(tmp_path / "g.png").shape == (68, 134, 3)


def test_official_train_checkpoint_reads_its_args(official_files, vae_dir):
    sm = load_sampling_model(official_files["train"], vae=vae_dir)  # model, size and classes from args
    assert (sm.weights, sm.image_size, sm.config.num_classes, sm.config.depth) == ("ema", 64, 10, 12)
    with pytest.raises(UserError, match="--image-size 128 does not match"):
        load_sampling_model(official_files["train"], image_size=128, vae=vae_dir)


# ---- guidance, samplers, seeding ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sm(our_ckpt):
    return load_sampling_model(our_ckpt)  # the run's own (tiny) VAE: it is not an SD VAE


def test_the_runs_own_vae_is_the_default_for_non_sd_vaes(sm, vae_dir):
    assert sm.vae_spec == vae_dir and sm.image_size == 64


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_samplers_with_and_without_guidance(sm, sampler):
    seeds = [noise_seed(0, i) for i in range(2)]
    images = {
        (scale, ch): generate(sm, Sampler(sm, int(STEPS), sampler, guidance=Guidance(scale, ch)), [3, 4], seeds)
        for scale, ch in [(1.0, 3), (4.0, 3), (4.0, "all")]
    }
    for x in images.values():
        assert x.shape == (2, 3, 64, 64) and torch.isfinite(x).all() and x.abs().max() <= 1
    assert not torch.equal(images[1.0, 3], images[4.0, 3]), "guidance must change the images"
    assert not torch.equal(images[4.0, 3], images[4.0, "all"]), "guiding all channels must differ from 3"


def test_ddpm_and_ddim_differ(sm):
    seeds = [noise_seed(0, 0)]
    assert not torch.equal(
        generate(sm, Sampler(sm, int(STEPS), "ddpm"), [1], seeds),
        generate(sm, Sampler(sm, int(STEPS), "ddim"), [1], seeds),
    )


def test_guided_batch_shares_noise_and_uses_the_null_label(sm, monkeypatch):
    seen = []
    original = DiT.forward

    def spy(self, x, t, y):
        seen.append((x.clone(), y.clone()))
        return original(self, x, t, y)

    monkeypatch.setattr(DiT, "forward", spy)
    generate(sm, Sampler(sm, 3, "ddpm", guidance=Guidance(1.5)), [1, 2, 3], [5, 6, 7])
    assert len(seen) == 3
    for x, y in seen:
        assert torch.equal(x[:3], x[3:]), "both halves of a guided batch must hold the same noisy input"
        assert y.tolist() == [1, 2, 3] + [sm.config.num_classes] * 3


def test_an_image_does_not_depend_on_its_batch(sm):
    """Per-image seeds: what makes a sample set the same on any number of devices."""
    diffusion = Sampler(sm, int(STEPS), "ddpm", guidance=Guidance(1.5))
    labels, seeds = [fid_label(0, i, 10) for i in range(3)], [noise_seed(0, i) for i in range(3)]
    together = generate(sm, diffusion, labels, seeds)
    alone = torch.cat([generate(sm, diffusion, [y], [s]) for y, s in zip(labels, seeds)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    assert noise_seed(0, 1) != noise_seed(1, 0) and noise_seed(0, 1) != noise_seed(0, 2)


def test_uint8_conversion_is_the_official_rounding():
    x = torch.tensor([-1.5, -1.0, -0.5, 0.0, 0.999, 1.0]).view(1, 1, 2, 3).repeat(1, 3, 1, 1)
    expected = np.clip(127.5 * x.numpy() + 128, 0, 255).astype(np.uint8)
    assert np.array_equal(to_uint8(x).numpy(), expected)
    assert to_uint8(x).dtype == torch.uint8 and to_uint8(x).shape == (1, 3, 2, 3)


def test_batches_cover_every_index_once_for_any_world_size():
    for world in (1, 2, 3, 5):
        got = sorted(i for r in range(world) for b in batches(11, 3, r, world) for i in b)
        assert got == list(range(11))
        firsts = sorted(b[0] for r in range(world) for b in batches(11, 3, r, world))
        assert firsts == [0, 3, 6, 9], "batch boundaries must not depend on the world size"


# ---- pixel space ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 3])
def test_pixel_space_checkpoint_skips_the_vae(tmp_path, channels, capsys):
    ckpt = write_our_checkpoint(tmp_path, None, in_channels=channels, input_size=16)
    argv = sample_args(ckpt, tmp_path / "p.png", "--class-labels", 1, 2, "--cfg-scale", 1)
    code, out, err = run_face("sample.py", argv, capsys)
    assert code == 0, err
    assert pixels(tmp_path / "p.png").shape == (20, 38, 3)
    assert "TFLOP/image" in out and "VAE decode" not in out and "guidance" not in out  # pixels, unguided


def test_bare_pixel_state_dict_with_vae_none(tmp_path):
    torch.save(tiny_dit(in_channels=3, input_size=16).state_dict(), tmp_path / "pix.pt")
    with pytest.raises(UserError, match="pass --num-heads"):  # no registry width: its head count is asked for
        load_sampling_model(tmp_path / "pix.pt", image_size=16, num_classes=10, vae="none")
    with pytest.raises(
        UserError, match=r"--model DiT-S/2 does not match .*custom \(depth 2, hidden 32, patch 2\)"
    ):
        load_sampling_model(tmp_path / "pix.pt", model="DiT-S/2", image_size=16, num_classes=10, num_heads=4,
                            vae="none")  # fmt: skip
    sm = load_sampling_model(tmp_path / "pix.pt", image_size=16, num_classes=10, num_heads=4, vae="none")
    assert sm.config.num_heads == 4


# ---- cost ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("guidance_scale", [1.0, 2.0])
def test_reported_flops_are_the_cost_packages_formula(our_ckpt, tmp_path, guidance_scale):
    report = run_sample(
        SampleConfig.of(
            ckpt=str(our_ckpt),
            out=str(tmp_path / "g.png"),
            num_sampling_steps=int(STEPS),
            class_labels=[1, 2, 3],
            guidance_scale=guidance_scale,
            precision="fp32",
            peak_tflops=0.5,
            progress=False,
        ),
        Runtime("cpu", "fp32"),
    )
    sm = load_sampling_model(our_ckpt)
    decode = vae_flops(dict(sm.vae.config), 64).decode
    expected = sampling_flops_per_image(sm.config, int(STEPS), guidance_scale, vae_decode_flops=decode)
    cost = report.cost
    assert cost.model_flops_per_image == expected.model and cost.vae_flops_per_image == expected.vae_decode > 0
    assert cost.flops_per_image == expected.total
    assert cost.images == 3 and cost.dit_s > 0 and cost.decode_s > 0 and cost.wall_s == cost.dit_s + cost.decode_s
    assert cost.images_per_s == pytest.approx(3 / cost.wall_s)
    assert cost.peak.flops == 0.5e12
    # each MFU divides the FLOPs of one part by the time of that part
    assert cost.mfu == pytest.approx(expected.model * 3 / cost.dit_s / 0.5e12)
    assert cost.mfu_with_vae == pytest.approx(expected.total * 3 / cost.wall_s / 0.5e12)
    assert ("guidance doubles the batch" in cost.summary()) == (guidance_scale > 1)


def test_the_cost_line_counts_the_guided_and_unguided_evaluations_that_ran(our_ckpt, tmp_path, capsys):
    from dit.cost.analytic import forward_macs
    from dit.objectives.samplers import sampling_plan

    argv = sample_args(our_ckpt, tmp_path / "g.png", "--sampler", "unipc", "--cfg-scale", 4, "--class-labels", 1, 2,
                       "--guidance-interval", 0.3, 0.7)  # fmt: skip
    code, out, err = run_face("sample.py", argv, capsys)
    assert code == 0, err
    plan = sampling_plan("unipc", int(STEPS), guidance_scale=4, interval=(0.3, 0.7))
    assert 0 < plan.guided_nfe < plan.nfe
    assert (
        f"unipc: {plan.nfe} network evaluations (NFE): {plan.guided_nfe} guided x 2 passes, guidance doubles the "
        f"batch + {plan.unguided_nfe} unguided x 1 pass"
    ) in out
    report = run_sample(
        SampleConfig.of(ckpt=str(our_ckpt), out=str(tmp_path / "h.png"), num_sampling_steps=int(STEPS), sampler="unipc",
                     class_labels=[1], guidance_scale=4, guidance_interval=[0.3, 0.7], precision="fp32",
                     peak_tflops=1.0, progress=False),
        Runtime("cpu", "fp32"),
    )  # fmt: skip
    forward = forward_macs(load_sampling_model(our_ckpt).config).flops
    assert report.cost.model_flops_per_image == forward * plan.forward_passes


# ---- bad input ------------------------------------------------------------------------------------------


def test_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    code, _, err = run_face("sample.py", sample_args(tmp_path / "nope.pt", tmp_path / "g.png"), capsys)
    assert code == 2 and "does not exist" in err and "Traceback" not in err


def test_checkpoint_for_another_model_names_the_model_its_weights_are(official_files, vae_dir, tmp_path, capsys):
    argv = sample_args(official_files["bare"], tmp_path / "g.png", "--model", "DiT-B/8", "--image-size", 64)
    code, _, err = run_face("sample.py", argv + ["--num-classes", "10", "--vae", vae_dir], capsys)
    assert code == 2 and err.startswith("error: --model DiT-B/8 does not match") and "weights are DiT-S/8" in err


def test_checkpoint_for_another_image_size_names_the_size_its_weights_take(
    official_files, vae_dir, tmp_path, capsys
):
    argv = sample_args(official_files["bare"], tmp_path / "g.png", "--model", "DiT-S/8", "--image-size", 128)
    code, _, err = run_face("sample.py", argv + ["--num-classes", "10", "--vae", vae_dir], capsys)
    assert code == 2 and "takes 8: pass --image-size 64" in err  # the weights' pos_embed says 8x8 latents


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--class-labels", "3", "10"], "class labels [10] are out of range"),
        (["--class-labels", "-1"], "class labels [-1] are out of range"),
        (["--cfg-scale", "0.5"], "--guidance-scale (--cfg-scale) must be >= 1"),
        (["--image-size", "128"], "--image-size 128 does not match"),
        (["--vae", "none"], "--vae none asks for a pixel-space model"),
        (["--model", "DiT-S/2"], "--model DiT-S/2 does not match"),
        (["--guidance-interval", "0.7", "0.3"], "--guidance-interval takes two times LO HI"),
        (["--sampler", "ode"], "--sampler ode does not sample a diffusion model"),
    ],
)
def test_bad_requests_are_clear_errors(our_ckpt, tmp_path, capsys, flags, message):
    code, _, err = run_face("sample.py", sample_args(our_ckpt, tmp_path / "g.png", *flags), capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "g.png").exists()


def test_sd_runs_decode_with_the_official_default_decoders(tmp_path, monkeypatch):
    """sample.py decodes SD latents with mse, sample_ddp.py with ema (as the official scripts); --vae wins."""
    asked = []
    monkeypatch.setattr(
        "dit.sample.loading.load_vae", lambda spec, device, dtype: asked.append(spec) or build_tiny_vae()
    )
    ckpt = write_our_checkpoint(tmp_path, "ema")
    assert load_sampling_model(ckpt).vae_spec == "mse"
    assert load_sampling_model(ckpt, sd_decoder="ema").vae_spec == "ema"
    assert load_sampling_model(ckpt, vae="stabilityai/sd-vae-ft-ema").vae_spec == "stabilityai/sd-vae-ft-ema"
    assert asked == ["mse", "ema", "stabilityai/sd-vae-ft-ema"]
