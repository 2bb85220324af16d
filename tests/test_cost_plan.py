"""Training and sampling plans: the issue's example command, calibration files, and bad input."""

import json

import pytest

from dit.cost.__main__ import main
from dit.cost.analytic import forward_macs, vae_flops
from dit.cost.plan import (
    Budget,
    Calibration,
    load_calibration,
    model_for_image,
    plan_sampling,
    plan_training,
    save_calibration,
)
from dit.cost.vae_facts import SD_VAE_CONFIG
from dit.io.errors import UserError
from dit.model.config import model_config

ISSUE_COMMAND = (
    "train --model DiT-XL/2 --image-size 256 --global-batch-size 256 --max-steps 400000 --gpu H100-SXM "
    "--num-gpus 8 --mfu 0.4"
).split()


def test_issue_command_arithmetic(capsys):
    assert main([*ISSUE_COMMAND, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    forward_flops = 2 * forward_macs(model_config("DiT-XL/2")).total
    total = 3 * forward_flops * 256 * 400_000
    h100_bf16 = 989.4e12  # H100 SXM dense bf16 datasheet
    seconds = total / (8 * h100_bf16 * 0.4)
    assert plan["total_flops"] == pytest.approx(total, rel=1e-12)
    assert plan["total_macs"] == pytest.approx(total / 2, rel=1e-12)
    assert plan["device_hours"] == pytest.approx(8 * seconds / 3600, rel=1e-12)
    assert plan["days"] == pytest.approx(seconds / 86400, rel=1e-12)
    assert plan["peak_tflops_per_device"] == 989.4 and plan["device"] == "H100 SXM"
    # the same plan in round numbers: 72.9 EFLOP, ~51 H100-hours, ~0.27 days
    assert round(plan["total_flops"] / 1e18, 1) == 72.9 and round(plan["device_hours"]) == 51


def test_issue_command_prints_flops_hours_and_days(capsys):
    assert main(ISSUE_COMMAND) == 0
    out = capsys.readouterr().out
    for line in ("total FLOPs", "7.2881e+19", "device-hours", "51.2", "days", "0.266"):
        assert line in out


def test_price_and_memory_lines():
    cfg = model_for_image("DiT-XL/2", 256)
    plan = plan_training(
        cfg, 256, 256, 1000, Budget(8, "NVIDIA H100 80GB HBM3", mfu=0.4, price_per_device_hour=2.5)
    )
    assert plan.timing.cost == pytest.approx(plan.timing.device_hours * 2.5)
    assert 10 < plan.memory.memory_gib_per_device < plan.memory.device_memory_gib == 80


def test_precision_changes_the_peak_not_the_flops():
    cfg = model_for_image("DiT-XL/2", 256)
    bf16 = plan_training(cfg, 256, 256, 1000, Budget(8, "A100", mfu=0.4))
    tf32 = plan_training(cfg, 256, 256, 1000, Budget(8, "A100", precision="tf32", mfu=0.4))
    assert tf32.total_flops == bf16.total_flops
    assert tf32.timing.days == pytest.approx(2 * bf16.timing.days)  # A100: 156 vs 312 TFLOP/s


def test_calibration_round_trip_and_matching(tmp_path):
    path = str(tmp_path / "calibration.json")
    save_calibration(
        Calibration("DiT-XL/2", 256, "bf16", "NVIDIA H100 80GB HBM3", 0.41), path, batch_per_device=32
    )
    assert load_calibration(path).mfu == 0.41
    assert json.load(open(path))["batch_per_device"] == 32
    cfg = model_for_image("DiT-XL/2", 256)
    plan = plan_training(cfg, 256, 256, 1000, Budget(8, calibration=path))
    assert plan.timing.mfu == 0.41 and plan.timing.device == "H100 SXM" and path in plan.timing.mfu_source
    with pytest.raises(UserError, match="does not carry over"):
        plan_training(model_for_image("DiT-B/2", 256), 256, 256, 1000, Budget(8, calibration=path))
    with pytest.raises(UserError, match="measured on"):
        plan_training(cfg, 256, 256, 1000, Budget(8, "A100", calibration=path))
    with pytest.raises(UserError, match="not both"):
        plan_training(cfg, 256, 256, 1000, Budget(8, "A100", mfu=0.3, calibration=path))


@pytest.mark.parametrize(
    "content,match",
    [
        ("{", "not valid JSON"),
        ('{"model": "DiT-XL/2"}', "lacks"),
        ('{"model": "DiT-XL/2", "image_size": 256, "precision": "bf16", "device": "H100", "mfu": 1.7}', "mfu"),
    ],
)
def test_bad_calibration_files(tmp_path, content, match):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(UserError, match=match):
        load_calibration(str(path))
    with pytest.raises(UserError, match="does not exist"):
        load_calibration(str(tmp_path / "missing.json"))


def test_sampling_plan():
    cfg = model_for_image("DiT-XL/2", 256)
    plan = plan_sampling(cfg, 256, 50_000, 250, 1.5, Budget(8, "H100-SXM", mfu=0.4))
    per_image = 250 * 2 * forward_macs(cfg).flops + vae_flops(SD_VAE_CONFIG, 256).decode
    assert plan.total_flops == pytest.approx(50_000 * per_image)
    assert plan.timing.seconds == pytest.approx(50_000 * per_image / (8 * 989.4e12 * 0.4))
    unguided = plan_sampling(cfg, 256, 50_000, 250, 1.0, Budget(8, "H100-SXM", mfu=0.4), vae_config=None)
    assert unguided.total_flops == pytest.approx(50_000 * 250 * forward_macs(cfg).flops)


def test_pixel_space_and_custom_models():
    pixel = model_for_image(None, 64, vae=False, depth=4, hidden_size=128, num_heads=4, patch_size=4)
    assert (pixel.input_size, pixel.in_channels, pixel.tokens) == (64, 3, 256)
    assert model_for_image("DiT-S/2", 512).input_size == 64
    assert model_for_image("DiT-S/2", 256, latent_size=16, in_channels=8).in_channels == 8


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: model_for_image("DiT-S/2", 100), "--image-size"),
        (lambda: model_for_image(None, 256, depth=4), "--hidden-size"),
        (lambda: model_for_image("DiT-Q/2", 256), "DiT-XL/2"),
        (lambda: plan_training(model_config("DiT-S/2"), 256, 256, 5, Budget(6, "A100", mfu=0.4)), "--num-gpus"),
        (lambda: plan_training(model_config("DiT-S/2"), 256, 256, 5, Budget(8, "A100")), "--mfu"),
        (lambda: plan_training(model_config("DiT-S/2"), 256, 256, 5, Budget(8, mfu=0.4)), "--gpu"),
    ],
)
def test_bad_numbers_name_the_argument(call, match):
    with pytest.raises(UserError, match=match):
        call()


@pytest.mark.parametrize(
    "argv,match",
    [
        ("flops --model DiT-S/2 --image-size -8", "--image-size must be >= 1, got -8."),
        ("train --model DiT-S/2 --max-steps -5", "--max-steps must be >= 1, got -5."),
        ("train --model DiT-S/2 --gpu A100 --mfu 1.5", "--mfu must be <= 1, got 1.5."),
        (
            "train --model DiT-S/2 --gpu A100 --mfu 0.4 --price-per-hour -1",
            "--price-per-hour must be > 0, got -1.0.",
        ),
        ("sample --model DiT-S/2 --num-images 0", "--num-images must be >= 1, got 0."),
    ],
)
def test_bad_numbers_are_refused_at_their_flag(capsys, argv, match):
    """A number's bound is its flag's: the plans take what the sections checked."""
    assert main(argv.split()) == 2
    assert capsys.readouterr().err == f"error: {match}\n"


def test_unknown_gpu_lists_devices_and_the_override():
    cfg = model_config("DiT-S/2")
    with pytest.raises(UserError) as err:
        plan_training(cfg, 256, 256, 5, Budget(8, "Imaginary X9000", mfu=0.4))
    assert "H100 SXM" in str(err.value) and "--peak-tflops" in str(err.value)
    plan = plan_training(cfg, 256, 256, 5, Budget(8, "Imaginary X9000", mfu=0.4, peak_tflops=500))
    assert plan.timing.peak_tflops_per_device == 500 and plan.timing.peak_source == "override"


def test_compute_without_a_device_has_the_same_keys(capsys):
    """FLOPs need no device: the plan without --gpu/--mfu has every key, the time and money ones null."""
    with_device = ISSUE_COMMAND + ["--json"]
    assert main(with_device) == 0
    timed = json.loads(capsys.readouterr().out)
    compute_only = [a for a in with_device if a not in ("--gpu", "H100-SXM", "--mfu", "0.4")]
    assert main(compute_only) == 0
    untimed = json.loads(capsys.readouterr().out)
    assert untimed.keys() == timed.keys()
    assert all(untimed[k] is None for k in ("device", "mfu", "seconds", "device_hours", "days", "cost"))
    for k in ("total_flops", "total_macs", "step_flops", "train_gflops_per_image", "vae_encode_gflops_per_image"):
        assert untimed[k] == timed[k] and untimed[k] > 0
    assert untimed["vae_encode_gflops_per_image"] == pytest.approx(vae_flops(SD_VAE_CONFIG, 256).encode / 1e9)
    assert untimed["step_flops"] == pytest.approx(256 * untimed["train_gflops_per_image"] * 1e9)

    sample = "sample --model DiT-XL/2 --num-sampling-steps 250 --cfg-scale 1.5 --json".split()
    assert main(sample) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["seconds"] is None and got["forward_passes_per_image"] == 500 and got["guided"]
    assert got["total_flops"] == pytest.approx(got["total_model_flops"] + got["total_vae_flops"])
    assert got["total_macs"] == got["total_flops"] / 2
    assert main([*sample[:-1], "--vae", "none", "--guidance-scale", "1"]) == 0
    text = capsys.readouterr().out
    assert "1 pass (no guidance)" in text and "VAE decode" not in text and "--gpu and --mfu" in text


def test_a_device_without_an_mfu_or_a_price_without_a_device_is_refused(capsys):
    assert main("train --model DiT-S/2 --gpu A100".split()) == 2
    assert "--mfu" in capsys.readouterr().err
    assert main("sample --model DiT-S/2 --price-per-hour 2".split()) == 2
    assert "--price-per-hour needs" in capsys.readouterr().err
