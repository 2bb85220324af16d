"""The frontier recipes' study on the digits (studies/scaling.py, issue 38 item 7): the recipes build, token
dropping's steps are as cheap as the meta-device count says, and the verdict's ratios and ranges."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import face, run_face

from dit.cost.measured import measure_flops
from dit.io.config import flatten_record
from dit.train.recipes import PRESETS, digits_train_config

scaling = face("studies/scaling.py")
NEW = ("token-drop", "time-shift", "cos-loss", "adam-beta2", "frontier")


def _config(recipe: str, tmp_path: Path):
    c = scaling.FACE.parse(["--results-dir", str(tmp_path)]).sections["scaling"]
    study = scaling.study_options(c, "diffusion", 0, 10, 5)
    options = scaling.recipe_options(recipe)
    assert not set(study) & set(options), "a recipe sets an option the study fixes"
    return digits_train_config(PRESETS["default"], 10, tmp_path, None).replace(**study, **options)


@pytest.mark.parametrize("recipe", NEW)
def test_each_frontier_recipe_builds_the_digits_config_it_names(recipe, tmp_path):
    cfg = _config(recipe, tmp_path)
    flat = flatten_record(cfg.record())
    for name, value in scaling.recipe_options(recipe).items():
        assert flat[name] == value, name
    assert cfg.objective.objective == "diffusion" and cfg.objective.predict_xstart  # the baseline's objective
    assert cfg.model_config(1, cfg.model.image_size).depth == 6  # the study's M model


def test_the_stack_holds_every_recipe_it_names():
    stack = scaling.recipe_options("frontier")
    for part in scaling.FRONTIER:
        assert scaling.RECIPES[part].items() <= stack.items(), part
    assert stack["token_drop"] == 0.5 and stack["time_shift"] == "auto" and stack["adam_beta2"] == 0.95


def test_a_token_drop_step_costs_what_the_meta_device_counts(tmp_path):
    base, dropped = _config("baseline", tmp_path), _config("token-drop", tmp_path)
    models = [cfg.model_config(1, cfg.model.image_size) for cfg in (base, dropped)]
    forward = [measure_flops(m, batch_size=2, train=False)["forward_flops_per_image"] for m in models]
    steps = [scaling.flops_per_step(cfg, 64) for cfg in (base, dropped)]
    assert steps[0][0] == pytest.approx(3 * forward[0] * 64, rel=1e-12)  # model FLOPs: 3 x the forward
    assert steps[0][0] / steps[1][0] == pytest.approx(forward[0] / forward[1], rel=1e-12)
    assert steps[1][0] < steps[0][0] / 1.1 and steps[1][1:] == (0.0, 0.0)


def _run(tmp_path: Path, name: str, recipe: str, points: list[tuple[float, float, float]]) -> dict:
    """A run folder whose evaluations are (PFLOPs, digit FID, judge FD), one every 100 steps."""
    folder = tmp_path / name
    folder.mkdir()
    evals = [dict(kind="eval", step=100 * (i + 1), total_model_pflops=p, fid=f, fd_judge=d)
             for i, (p, f, d) in enumerate(points)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return {"folder": str(folder), "recipe": recipe, "steps": evals[-1]["step"], "evaluations": evals}


def test_the_verdict_measures_each_recipe_to_the_baselines_final_quality(tmp_path):
    runs = {
        # the baseline's worse finals (FID 80, FD 0.02) are the quality to reach
        "b0": _run(tmp_path, "b0", "baseline", [(0.008, 800, 0.1), (0.016, 80, 0.03), (0.024, 60, 0.01)]),
        "b1": _run(tmp_path, "b1", "baseline", [(0.008, 700, 0.1), (0.016, 200, 0.05), (0.024, 80, 0.02)]),
        # reaches both at 0.008 (seed 0) and between 0.004 and 0.016 (seed 1): apart under both judges
        "f0": _run(tmp_path, "f0", "fast", [(0.004, 300, 0.05), (0.008, 80, 0.02), (0.016, 30, 0.01)]),
        "f1": _run(tmp_path, "f1", "fast", [(0.004, 160, 0.04), (0.016, 40, 0.01)]),
        # fewer FLOPs under the FID, but the judge FD of seed 1 only at the budget: within noise
        "m0": _run(tmp_path, "m0", "mixed", [(0.004, 300, 0.05), (0.008, 80, 0.02), (0.024, 30, 0.01)]),
        "m1": _run(tmp_path, "m1", "mixed", [(0.004, 160, 0.05), (0.016, 40, 0.03), (0.024, 30, 0.02)]),
        # seed 1 never reaches the FID, and neither seed the FD: more FLOPs than every baseline seed there
        "s0": _run(tmp_path, "s0", "slow", [(0.008, 900, 0.2), (0.024, 79, 0.021)]),
        "s1": _run(tmp_path, "s1", "slow", [(0.008, 900, 0.2), (0.024, 90, 0.03)]),
    }
    v = scaling.recipe_verdict(runs, "baseline", "model")
    assert v["baseline_quality"] == {"fid": 80, "fd_judge": 0.02}
    interpolated = 0.004 * 4 ** (2 / 3) * 1e15  # FID 160 -> 40 in log FLOPs: 2/3 of the way to 80
    fast = v["recipes"]["fast"]
    assert fast["flops_to_baseline_quality"]["fid"] == pytest.approx([8e12, interpolated])
    assert fast["flops_ratio"]["fid"] == pytest.approx([8e12 / 24e12, interpolated / 16e12])
    assert fast["seeds_apart"] == {"fid": True, "fd_judge": True}
    assert fast["both_judges"] and fast["claim"] == "fewer"
    mixed = v["recipes"]["mixed"]
    assert mixed["seeds_apart"] == {"fid": True, "fd_judge": False}
    assert not mixed["both_judges"] and mixed["claim"] == "within noise"
    slow = v["recipes"]["slow"]
    assert slow["flops_to_baseline_quality"]["fid"][1] is None and slow["flops_ratio"]["fid"][1] is None
    assert slow["flops_ratio"]["fid"][0] == pytest.approx(
        math.exp(math.log(0.008) + (900 - 80) / (900 - 79) * math.log(3)) / 0.024
    )
    assert slow["seeds_apart"] == {"fid": False, "fd_judge": True}  # seed 0's FID overlaps the baseline's
    assert slow["flops_ratio"]["fd_judge"] == [None, None] and slow["claim"] == "within noise"
    base = v["recipes"]["baseline"]
    assert base["flops_ratio"]["fid"] == pytest.approx([16 / 24, 24 / 16]) and base["claim"] == "within noise"


def test_67_a_verdict_against_a_recipe_the_study_does_not_run_is_one_line(tmp_path, capsys):
    argv = ["--recipes", "blocks:2", "--verdict", str(tmp_path / "v.json"), "--results-dir", str(tmp_path / "r")]
    code, _, err = run_face("studies/scaling.py", argv, capsys)
    assert code == 2 and err.startswith("error: --verdict") and "baseline:2" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_the_benchmark_times_the_digits_model_at_the_steps_the_study_counts(tmp_path):
    from dit.bench.steps import bench_train

    rows = bench_train(model="digits", batch_size=2, steps=1, warmup=0, device="cpu", peak_tflops=1.0,
                       token_drops=(0.0, 0.5))  # fmt: skip
    study = [scaling.flops_per_step(_config(recipe, tmp_path), 2)[0] for recipe in ("baseline", "token-drop")]
    assert [r["model_flops_per_step"] for r in rows] == pytest.approx(study, rel=1e-12)
    assert {r["image_size"] for r in rows} == {28} and [r["token_drop"] for r in rows] == [0.0, 0.5]


def test_the_after_training_options_reach_the_run_and_leave_the_others_as_they_were(tmp_path):
    plain = _config("baseline", tmp_path)
    c = scaling.FACE.parse(
        ["--results-dir", str(tmp_path), "--ema-profiles", "0.05", "0.1", "--ema-snapshot-every", "7",
         "--keep-evals"]
    ).sections["scaling"]  # fmt: skip
    study = scaling.study_options(c, "diffusion", 0, 10, 5)
    cfg = digits_train_config(PRESETS["default"], 10, tmp_path, None).replace(**study)
    flat, before = flatten_record(cfg.record()), flatten_record(plain.record())
    assert (
        tuple(flat["ema_profiles"]) == (0.05, 0.1) and flat["ema_snapshot_every"] == 7 and flat["keep_every"] == 5
    )
    changed = {k for k in flat if flat[k] != before[k]}
    assert changed == {"ema_profiles", "ema_snapshot_every", "keep_every"}  # the training itself is the baseline's
    assert before["ema_profiles"] is None and before["keep_every"] == 0
