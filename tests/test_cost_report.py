"""The typed plans' one renderer: every ``--json`` key, in order, with values from the formulas, and the text
lines that print them."""

import json

import pytest

from dit.cost.__main__ import main
from dit.cost.analytic import forward_macs, training_flops_per_image, vae_flops
from dit.cost.memory import estimate_training_memory
from dit.cost.peaks import table_peak
from dit.cost.plan import model_for_image
from dit.cost.vae_facts import SD_VAE_CONFIG

TIMING = ("device", "peak_tflops_per_device", "peak_source", "mfu", "mfu_source", "images_per_sec", "seconds",
          "device_hours", "days", "cost", "price_per_device_hour")  # fmt: skip
TRAIN = (
    "model", "description", "image_size", "global_batch_size", "batch_per_device", "num_devices", "precision",
    "steps", "images", "forward_gflops_per_image", "train_gflops_per_image", "train_gmacs_per_image",
    "hardware_gflops_per_image", "hardware_attention", "checkpointed_blocks", "step_flops", "total_flops",
    "total_macs", "vae_encode_gflops_per_image", "vae_encode_flops_per_step", "vae_encode_total_flops_on_the_fly",
    "repa_encoder_forward_gflops_per_image", "repa_projector_train_gflops_per_image", "repa_features_cached",
    "aux_gflops_per_image", "aux_share_of_dit", "aux_total_flops", *TIMING, "memory_gib_per_device",
    "device_memory_gib",
)  # fmt: skip
SAMPLE_HEAD = ("model", "description", "image_size", "num_images", "num_devices", "precision",
               "num_sampling_steps", "guidance_scale", "guided", "forward_passes_per_image", "forward_gflops")  # fmt: skip
SAMPLE_TAIL = ("model_gflops_per_image", "model_gmacs_per_image", "vae_decode_gflops_per_image", "gflops_per_image",
               "total_model_flops", "total_vae_flops", "total_flops", "total_macs", *TIMING, "sampler",
               "guidance_interval", "nfe", "guided_nfe", "unguided_nfe")  # fmt: skip
MEMORY = ("model", "batch_per_device", "precision", "ema", "sharding", "world_size", "checkpointed_blocks",
          "estimate_bytes", "estimate_parts", "peak_phase")  # fmt: skip


def _run(capsys, argv: str):
    assert main(argv.split()) == 0
    text = capsys.readouterr().out
    assert main([*argv.split(), "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "argv,devices,blocks,vae",
    [
        ("--model DiT-XL/2 --global-batch-size 256 --max-steps 1000 --gpu H100-SXM --num-gpus 8 --mfu 0.4", 8, 0, True),
        ("--model DiT-S/2 --max-steps 50 --gpu A100 --mfu 0.3 --price-per-hour 2 --activation-checkpointing 4", 1, 4, True),
        ("--model DiT-B/2 --vae none --image-size 32 --max-steps 10", 1, 0, False),
    ],
)  # fmt: skip
def test_training_plan_keys_values_and_text(capsys, argv, devices, blocks, vae):
    text, got = _run(capsys, "train " + argv)
    assert tuple(got) == TRAIN
    cfg = model_for_image(got["model"], got["image_size"], vae=vae)
    train = training_flops_per_image(cfg, blocks)
    images = got["global_batch_size"] * got["steps"]
    assert got["images"] == images and got["batch_per_device"] == got["global_batch_size"] // devices
    assert got["train_gflops_per_image"] == train.model / 1e9 and got["total_flops"] == float(train.model) * images
    assert got["step_flops"] == float(train.model) * got["global_batch_size"]
    assert got["total_macs"] == got["total_flops"] / 2 and got["aux_total_flops"] == 0
    encode = vae_flops(SD_VAE_CONFIG, got["image_size"]).encode if vae else None
    assert got["vae_encode_gflops_per_image"] == (encode / 1e9 if vae else None)
    memory = estimate_training_memory(cfg, got["batch_per_device"], "bf16", blocks, world_size=devices)
    assert got["memory_gib_per_device"] == memory.total / 2**30
    assert f"{got['step_flops']:.4e} FLOP" in text and f"{got['total_flops']:.4e} FLOP" in text
    if got["mfu"] is None:
        assert all(got[k] is None for k in TIMING) and "pass --gpu and --mfu" in text
        return
    peak = table_peak(got["device"], "bf16").flops
    assert got["seconds"] == pytest.approx(got["total_flops"] / (devices * peak * got["mfu"]), rel=1e-12)
    assert got["device_hours"] == pytest.approx(got["seconds"] * devices / 3600, rel=1e-12)
    assert got["cost"] == (
        got["device_hours"] * got["price_per_device_hour"] if got["price_per_device_hour"] else None
    )
    assert f"{got['mfu']:.3f} (given)" in text and ("cost" in text) == (got["cost"] is not None)


@pytest.mark.parametrize(
    "argv,guide",
    [
        ("--model DiT-XL/2 --num-sampling-steps 50 --cfg-scale 4 --gpu A100 --mfu 0.3 --price-per-hour 2", None),
        ("--model DiT-XL/2 --num-sampling-steps 50 --cfg-scale 2 --guide-model DiT-S/2", "DiT-S/2"),
        ("--model DiT-XL/2 --num-sampling-steps 50 --cfg-scale 1.5 --guidance-interval 0.1 0.7", None),
    ],
)
def test_sampling_plan_keys_values_and_text(capsys, argv, guide):
    text, got = _run(capsys, "sample " + argv)
    assert tuple(got) == SAMPLE_HEAD + (("guide_model", "guide_forward_gflops") if guide else ()) + SAMPLE_TAIL
    cfg = model_for_image("DiT-XL/2", 256)
    assert got["forward_gflops"] == forward_macs(cfg, ratio=0).flops / 1e9 and got["num_sampling_steps"] == 50
    assert got["guided_nfe"] + got["unguided_nfe"] == got["nfe"]
    assert got["total_flops"] == pytest.approx(got["total_model_flops"] + got["total_vae_flops"], rel=1e-12)
    assert got["total_vae_flops"] == vae_flops(SD_VAE_CONFIG, 256).decode * got["num_images"]
    assert f"{got['nfe']} network evaluations" in text and f"{got['total_flops']:.4e} FLOP" in text
    if guide:
        assert got["guide_forward_gflops"] == forward_macs(model_for_image(guide, 256), ratio=0).flops / 1e9
        assert "guide passes" in text
    if got["guidance_interval"]:
        assert got["guided_nfe"] < got["nfe"] and "guided in [0.1, 0.7]" in text
    if got["cost"] is not None:
        assert got["cost"] == got["device_hours"] * 2 and "at 2.0 per device-hour" in text


@pytest.mark.parametrize(
    "argv,extra",
    [
        ("--model DiT-S/2 --batch-per-device 8 --trace", ("traced_bytes", "traced_parts")),
        ("--model DiT-S/2 --global-batch-size 64 --num-gpus 8 --memory-gib 12 --activation-checkpointing auto",
         ("device_memory_bytes", "reserve_bytes", "max_batch_per_device")),
    ],
)  # fmt: skip
def test_memory_plan_keys_values_and_text(capsys, argv, extra):
    text, got = _run(capsys, "memory " + argv)
    assert tuple(got) == MEMORY + extra and got["batch_per_device"] == 8
    cfg = model_for_image("DiT-S/2", 256)
    options = {k: got[k] for k in ("precision", "ema", "sharding", "world_size", "checkpointed_blocks")}
    estimate = estimate_training_memory(cfg, 8, **options)
    assert got["estimate_bytes"] == estimate.total and got["estimate_parts"] == estimate.parts
    assert f"{estimate.total / 2**30:,.3f} GiB (at the {estimate.phase})" in text
    if "device_memory_bytes" in got:
        assert got["device_memory_bytes"] == 12 * 2**30
        assert f"largest batch per device that fits  {got['max_batch_per_device']}" in text
    else:
        assert f"analytic/traced {got['estimate_bytes'] / got['traced_bytes']:.3f}" in text


def test_post_hoc_ema_keys_follow_the_plan(capsys):
    """--ema-profiles adds the snapshots' disk after every other training key, and its line to the text."""
    from dit.cost.memory import snapshot_disk

    argv = "train --model DiT-S/2 --max-steps 20000 --ema-profiles 0.05 0.1 --ema-snapshot-every 1000"
    text, got = _run(capsys, argv)
    assert tuple(got) == TRAIN + ("ema_snapshots", "ema_snapshot_gib", "ema_snapshots_gib")
    count, each = snapshot_disk(model_for_image("DiT-S/2", 256), 2, 20000, 1000)
    assert (got["ema_snapshots"], got["ema_snapshot_gib"]) == (count, each / 2**30)
    assert got["ema_snapshots_gib"] == count * each / 2**30 and f"{count:,} x " in text
    _, mem = _run(capsys, "memory --model DiT-S/2 --batch-size 8 --ema-profiles 0.05 0.1")
    assert tuple(mem) == MEMORY[:6] + ("ema_profiles",) + MEMORY[6:]
