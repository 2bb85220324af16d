"""Autoguidance (Karras et al. 2024): a guide model in place of the unconditional pass, in every sampling face.

Tiny random pixel-space DiTs (8 px, 3 channels) saved as our checkpoints, with the record a run writes of its
objective; a guide is a checkpoint like them (equal, smaller, or of another task).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import run_face, tiny_dit

from dit.checkpoint import save_training_checkpoint
from dit.cost.analytic import forward_macs
from dit.objectives.samplers import sampling_plan
from dit.runtime import Runtime
from dit.sample.config import SampleConfig
from dit.sample.cost import measure_cost
from dit.sample.generate import Guidance, GuidedModel, Sampler, noise_seed, sample_latents
from dit.sample.grid import run_sample
from dit.sample.guide import GuideSection, load_guide
from dit.sample.loading import load_sampling_model

PIXELS = dict(in_channels=3, input_size=8)
FLOW = {"objective": "flow", "path_type": "linear", "prediction": "velocity"}
SMALL = dict(hidden_size=16, num_heads=2, depth=1)  # a guide of another size (the main model: TINY's 32 x 2)


def checkpoint(folder, seed: int = 0, record: dict | None = None, **model) -> str:
    """Our checkpoint of a tiny pixel-space DiT, its run's record ``record`` (the objective's fields)."""
    net = tiny_dit(seed, **{**PIXELS, **model})
    cfg = net.config
    payload = {
        "model": net.state_dict(),
        "ema": tiny_dit(seed + 1, **{**PIXELS, **model}).state_dict(),
        "optimizer": {},
        "config": {"model": "custom", "image_size": cfg.input_size, "vae": None, "num_classes": cfg.num_classes,
                   **(record or {})},
        "model_config": cfg.to_dict(),
    }  # fmt: skip
    return str(save_training_checkpoint(folder, 100, payload))


OBJECTIVES = {"diffusion": ({}, {}), "flow": (FLOW, {"learn_sigma": False})}


def sample(sm, guidance: Guidance, kind: str | None = None, steps: int = 6) -> torch.Tensor:
    sampler = Sampler(sm, steps, kind, guidance=guidance)
    labels = [1, 2, 3]
    return sample_latents(sm, sampler, labels, [noise_seed(0, i) for i in range(len(labels))])


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_the_model_as_its_own_guide_is_unguided_sampling_bit_for_bit(tmp_path, objective):
    record, model = OBJECTIVES[objective]
    ckpt = checkpoint(tmp_path, record=record, **model)
    sm = load_sampling_model(ckpt, vae="none")
    guide = load_guide(GuideSection(ckpt=ckpt), sm, "cpu")
    assert guide is not None and guide is not sm.model
    unguided = sample(sm, Guidance(1.0))
    assert torch.equal(sample(sm, Guidance(1.0, guide=guide)), unguided)
    # any scale: the guide's output equals the model's, so guide + w (model - guide) is the model's exactly
    assert torch.equal(sample(sm, Guidance(3.0, "all", guide=guide)), unguided)
    assert not torch.equal(sample(sm, Guidance(3.0)), unguided)  # classifier-free guidance does move it


@pytest.mark.parametrize("channels", [3, "all"])
def test_a_guided_evaluation_is_the_guide_plus_the_scaled_difference(channels):
    model, guide = tiny_dit(0, **PIXELS).eval(), tiny_dit(5, **PIXELS, **SMALL).eval()  # learned sigma: 6 channels
    x, t, y = (
        torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)),
        torch.tensor([500, 20]),
        torch.tensor([1, 4]),
    )
    fn = GuidedModel(model, Guidance(2.5, channels, guide=guide), None, plan=[True])
    out = fn(x, t, y)
    strong, weak = model(x, t, y), guide(x, t, y)
    moved = 3  # the noise channels: 3 of 3 either way; the variance channels are never guided
    expected = torch.cat([weak[:, :moved] + 2.5 * (strong[:, :moved] - weak[:, :moved]), strong[:, moved:]], dim=1)
    assert torch.equal(out, expected)
    assert not torch.equal(out[:, :moved], strong[:, :moved])
    assert (fn.guided, fn.unguided) == (1, 0)


def test_only_the_first_three_of_four_channels_are_guided_by_default():
    model, guide = tiny_dit(0, in_channels=4).eval(), tiny_dit(5, in_channels=4, **SMALL).eval()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([500, 20]), torch.tensor([1, 4])
    out = GuidedModel(model, Guidance(2.0, 3, guide=guide), None, plan=[True])(x, t, y)
    strong = model(x, t, y)
    assert torch.equal(out[:, 3:], strong[:, 3:]) and not torch.equal(out[:, :3], strong[:, :3])


def test_a_guided_run_costs_the_model_and_the_guide_per_guided_evaluation(tmp_path):
    ckpt, small = checkpoint(tmp_path / "main"), checkpoint(tmp_path / "guide", seed=7, **SMALL)
    sm = load_sampling_model(ckpt, vae="none")
    guide = load_guide(GuideSection(ckpt=small), sm, "cpu")
    calls = []
    guide.register_forward_hook(lambda *_: calls.append(1))
    sampler = Sampler(sm, 10, "ddim", guidance=Guidance(2.0, interval=(0.2, 0.7), guide=guide))
    sample_latents(sm, sampler, [1, 2], [noise_seed(0, i) for i in range(2)])
    plan = sampling_plan("ddim", 10, guidance_scale=2.0, interval=(0.2, 0.7))
    assert 0 < plan.guided_nfe < plan.nfe and len(calls) == plan.guided_nfe  # the guide runs on guided steps only
    cost = measure_cost(sm, sampler, 2, 1.0, 0.0, (None, "test"))
    main, weak = (forward_macs(c, ratio=0).flops for c in (sm.config, guide.config))
    assert weak < main
    assert cost.model_flops_per_image == plan.guided_nfe * (main + weak) + plan.unguided_nfe * main
    assert "the second pass the guide's" in cost.summary()


def test_dit_cost_sample_prices_a_guide_of_another_size(capsys):
    from dit.cost.plan import model_for_image

    base = ["sample", "--model", "DiT-XL/2", "--image-size", "256", "--num-sampling-steps", "50", "--cfg-scale", "2",
            "--guidance-interval", "0.1", "0.6", "--json"]  # fmt: skip
    code, out, err = run_face("dit/cost/__main__.py", [*base, "--guide-model", "DiT-S/2"], capsys)
    assert code == 0, err
    r = json.loads(out)
    main, weak = (forward_macs(model_for_image(m, 256), ratio=0).flops for m in ("DiT-XL/2", "DiT-S/2"))
    assert 0 < r["guided_nfe"] < r["nfe"] and r["guide_model"] == "DiT-S/2"
    assert r["model_gflops_per_image"] * 1e9 == pytest.approx(r["nfe"] * main + r["guided_nfe"] * weak, rel=1e-12)
    code, out, err = run_face("dit/cost/__main__.py", base, capsys)  # classifier-free: the model's own second pass
    assert json.loads(out)["model_gflops_per_image"] > r["model_gflops_per_image"]
    # an unconditional model has no unconditional pass to guide against, but a guide it can have
    uncond = ["sample", "--model", "DiT-XL/2", "--num-classes", "0", "--cfg-scale", "2", "--json"]
    assert run_face("dit/cost/__main__.py", [*uncond, "--guide-model", "DiT-S/2"], capsys)[0] == 0
    code, _, err = run_face("dit/cost/__main__.py", uncond, capsys)
    assert code == 2 and err.startswith("error:") and "nothing to guide against" in err


def test_sample_py_with_the_model_as_guide_at_scale_1_writes_the_unguided_grid(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "main")
    argv = [
        "--ckpt",
        ckpt,
        "--num-sampling-steps",
        "5",
        "--cfg-scale",
        "1",
        "--precision",
        "fp32",
        "--no-progress",
    ]
    assert run_face("sample.py", [*argv, "--out", str(tmp_path / "a.png")], capsys)[0] == 0
    code, out, err = run_face("sample.py", [*argv, "--out", str(tmp_path / "b.png"), "--guide-ckpt", ckpt], capsys)
    assert code == 0, err
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_sample_py_guides_with_the_raw_or_ema_weights_of_an_earlier_checkpoint(tmp_path):
    ckpt, early = checkpoint(tmp_path / "main"), checkpoint(tmp_path / "early", seed=3)
    grids = []
    for ema in (True, False):
        c = SampleConfig.of(ckpt=ckpt, guide_ckpt=early, guide_ema=ema, guidance_scale=2.0, num_sampling_steps=5,
                            out=str(tmp_path / f"{ema}.png"), precision="fp32", progress=False)  # fmt: skip
        with Runtime.of(c.runtime) as runtime:
            report = run_sample(c, runtime)
        assert report.cost.guide and report.cost.guided_nfe == 5
        grids.append(report.path.read_bytes())
    assert grids[0] != grids[1]  # --no-guide-ema takes the guide's other weights


BAD_GUIDES = {
    "classes": ({}, {"num_classes": 5}, "5 classes, the model 10"),
    "image size": ({}, {"input_size": 16}, "16 px images, the model 8 px"),
    "latent shape": ({}, {"in_channels": 1}, "inputs of 1 x 8^2, the model 3 x 8^2"),
    "objective": (FLOW, {"learn_sigma": False}, "objective flow, the model diffusion"),
    "prediction": ({"predict_xstart": True}, {}, "predict_xstart True, the model False"),
    "learned sigma": ({}, {"learn_sigma": False}, "learn_sigma False, the model True"),
}


@pytest.mark.parametrize("case", BAD_GUIDES)
def test_a_guide_of_another_task_is_one_error_line_and_nothing_written(tmp_path, capsys, case):
    record, model, message = BAD_GUIDES[case]
    ckpt, bad = checkpoint(tmp_path / "main"), checkpoint(tmp_path / "bad", record=record, **model)
    out = tmp_path / "grid.png"
    argv = ["--ckpt", ckpt, "--guide-ckpt", bad, "--out", str(out), "--num-sampling-steps", "5", "--no-progress"]
    code, _, err = run_face("sample.py", argv, capsys)
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    assert message in err and bad in err
    assert not out.exists()


def test_a_flow_guide_of_another_prediction_is_refused(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "main", record=FLOW, learn_sigma=False)
    bad = checkpoint(tmp_path / "bad", record={**FLOW, "prediction": "noise"}, learn_sigma=False)
    code, _, err = run_face(
        "sample.py", ["--ckpt", ckpt, "--guide-ckpt", bad, "--out", str(tmp_path / "g.png")], capsys
    )
    assert code == 2 and "prediction noise, the model velocity" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("case", ["path drop", "no file"])
def test_guide_with_path_drop_or_without_a_file_is_one_error_line(tmp_path, capsys, case):
    ckpt = checkpoint(tmp_path / "main")
    guide, extra, message = {"path drop": (ckpt, ["--guidance-path-drop"], "pass one of them"),
                             "no file": (str(tmp_path), [], "(--guide-ckpt)")}[case]  # fmt: skip
    argv = ["--ckpt", ckpt, "--guide-ckpt", guide, *extra, "--out", str(tmp_path / "g.png")]
    code, _, err = run_face("sample.py", argv, capsys)
    assert code == 2 and err.startswith("error:") and message in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "g.png").exists()


def test_an_unconditional_model_can_be_guided_by_a_guide(tmp_path):
    ckpt, small = (
        checkpoint(tmp_path / "main", num_classes=0),
        checkpoint(tmp_path / "g", seed=4, num_classes=0, **SMALL),
    )
    sm = load_sampling_model(ckpt, vae="none")
    guide = load_guide(GuideSection(ckpt=small), sm, "cpu")
    assert not torch.equal(sample(sm, Guidance(2.0, guide=guide)), sample(sm, Guidance(1.0)))


def test_sample_ddp_takes_a_guide_and_never_mixes_two_guides_in_one_set(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "main")
    guide_a, guide_b = checkpoint(tmp_path / "a", seed=3, **SMALL), checkpoint(tmp_path / "b", seed=4, **SMALL)
    argv = ["--ckpt", ckpt, "--sample-dir", str(tmp_path / "sets"), "--num-fid-samples", "4", "--batch-size", "2",
            "--num-sampling-steps", "4", "--cfg-scale", "2", "--precision", "fp32", "--no-progress"]  # fmt: skip
    code, out, err = run_face("scripts/sample_ddp.py", [*argv, "--guide-ckpt", guide_a], capsys)
    assert code == 0, err
    (npz,) = (tmp_path / "sets").glob("*.npz")
    assert "-guide-" in npz.name and np.load(npz)["arr_0"].shape == (4, 8, 8, 3)
    manifest = json.loads((tmp_path / "sets" / npz.stem / "sample_set.json").read_text())
    assert manifest["guide"]["weights"] == "ema" and len(manifest["guide"]["ckpt_sha256"]) == 64
    assert "the second pass the guide's" in out
    # guide b has the same file name (0000100.pt): the same folder, but another set
    code, _, err = run_face("scripts/sample_ddp.py", [*argv, "--guide-ckpt", guide_b], capsys)
    assert code == 2 and "other settings" in err
    bad = checkpoint(tmp_path / "bad", num_classes=5)
    code, _, err = run_face(
        "scripts/sample_ddp.py", [*argv, "--sample-dir", str(tmp_path / "new"), "--guide-ckpt", bad], capsys
    )
    assert code == 2 and err.startswith("error:") and "5 classes" in err
    assert not (tmp_path / "new").exists()


def test_sampling_study_takes_a_guide_and_counts_its_flops(tmp_path, capsys):
    digits = dict(in_channels=1, input_size=28, patch_size=4)
    ckpt, small = checkpoint(tmp_path / "main", **digits), checkpoint(tmp_path / "g", seed=2, **digits, **SMALL)
    out = tmp_path / "study.json"
    argv = ["--ckpt", ckpt, "--out", str(out), "--samplers", "ddim", "--nfe", "5", "--guidance", "2",
            "--intervals", "all", "--num-samples", "70", "--batch-size", "35"]  # fmt: skip
    code, _, err = run_face("studies/sampling_study.py", [*argv, "--guide-ckpt", small], capsys)
    assert code == 0, err
    study = json.loads(out.read_text())
    (row,) = study["rows"]
    main, weak = (forward_macs(load_sampling_model(p, vae="none").config, ratio=0).flops for p in (ckpt, small))
    assert row["guided_nfe"] == 5 and row["sampling_tflop_per_1000"] == pytest.approx(
        5 * (main + weak) * 1000 / 1e12
    )
    assert study["guide"]["weights"] == "ema"
    code, _, err = run_face("studies/sampling_study.py", argv, capsys)  # without the guide: another study
    assert code == 2 and "holds a study of other settings" in err
