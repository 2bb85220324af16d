"""CostMeter: rates, MFU/HFU, pauses and resets over windows with injected clock times."""

import pytest

from dit.cost.analytic import training_flops_per_image
from dit.cost.meter import CostMeter
from dit.cost.peaks import Peak
from dit.model.config import model_config

PEAK = Peak(1e15, "override", "test device", "bf16")


def meter(world_size=1, start=100.0):
    m = CostMeter(3e9, 4e9, 256, PEAK, world_size=world_size)
    m.reset_clock(now=start)
    return m


def test_window_rates_and_utilisation():
    m = meter(world_size=4)
    for _ in range(10):
        m.step(32, data_wait_s=0.1)
    w = m.window(now=104.0)
    assert w["images_per_sec_per_device"] == pytest.approx(80.0)
    assert w["images_per_sec"] == pytest.approx(320.0)
    assert w["steps_per_sec"] == pytest.approx(2.5)
    assert w["tokens_per_sec_per_device"] == pytest.approx(80.0 * 256)
    assert w["model_tflops_per_device"] == pytest.approx(80 * 3e9 / 1e12)
    assert w["mfu"] == pytest.approx(80 * 3e9 / 1e15)
    assert w["hfu"] == pytest.approx(w["mfu"] * 4 / 3)
    assert w["host_data_wait_frac"] == pytest.approx(0.25)
    assert (w["peak_tflops"], w["peak_source"]) == (1000.0, "override")
    assert w["total_model_pflops"] == pytest.approx(320 * 4 * 3e9 / 1e15)


def test_window_resets_and_pauses_are_excluded():
    m = meter()
    m.step(10)
    m.window(now=101.0)
    m.step(10)
    m.pause(now=102.0)  # e.g. a checkpoint save
    m.resume(now=110.0)
    m.step(10)
    w = m.window(now=111.0)
    assert w["window_s"] == pytest.approx(2.0)  # 101 -> 111 less the 8 s pause
    assert w["images_per_sec_per_device"] == pytest.approx(10.0)


def test_window_taken_while_paused_and_reset_clock_drops_warmup():
    m = meter()
    m.step(5)
    m.pause(now=102.0)
    w = m.window(now=105.0)
    assert w["window_s"] == pytest.approx(2.0)
    m.resume(now=107.0)  # the pause carried into the new window: 105 -> 107 is excluded
    m.step(5)
    assert m.window(now=108.0)["window_s"] == pytest.approx(1.0)
    m.step(1000)  # warm-up and compile
    m.reset_clock(now=200.0)
    m.step(8)
    assert m.window(now=202.0)["images_per_sec_per_device"] == pytest.approx(4.0)
    assert m.total_images == 5 + 5 + 1000 + 8


def test_empty_window_is_zero_not_an_error():
    w = meter().window(now=100.0)
    assert w["mfu"] == 0.0 and w["images_per_sec"] == 0.0


def test_hfu_over_mfu_for_full_checkpointing_is_about_four_thirds():
    cfg = model_config("DiT-XL/2")
    train = training_flops_per_image(cfg, checkpointed_blocks=cfg.depth, fused_attention=False)
    m = CostMeter(train.model, train.hardware, cfg.tokens, PEAK)
    m.reset_clock(now=0.0)
    m.step(64)
    w = m.window(now=1.0)
    assert 1.32 < w["hfu"] / w["mfu"] < 4 / 3


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        CostMeter(1, 1, 1, PEAK, world_size=0)
