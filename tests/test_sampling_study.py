"""scripts/sampling_study.py on a tiny digit-shaped model: two settings scored by both judges, the chart drawn, a
rerun resumed; its kept features judged by scripts/sampling_verdicts.py and measured by scripts/sample_count.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_face, write_our_checkpoint

pytest.importorskip("diffusers")


def test_two_settings_are_scored_plotted_and_not_run_again(tmp_path, capsys):
    ckpt = write_our_checkpoint(
        tmp_path, None, in_channels=1, input_size=28, patch_size=4
    )  # 28x28 digits, 10 classes
    out = tmp_path / "study.json"
    argv = ["--ckpt", str(ckpt), "--out", str(out), "--samplers", "ddim", "dpmpp-2m", "--nfe", "5", "--guidance", "2",
            "--intervals", "0.2:0.7", "--num-samples", "70", "--batch-size", "35"]  # fmt: skip
    code, _, err = run_face("scripts/sampling_study.py", argv, capsys)
    assert code == 0, err
    rows = json.loads(out.read_text())["rows"]
    assert [(r["sampler"], r["steps"], r["nfe"]) for r in rows] == [("ddim", 5, 5), ("dpmpp-2m", 5, 5)]
    for r in rows:
        assert r["fid"] > 0 and r["fd_judge"] > 0 and 0 <= r["class_accuracy"] <= 1 and 0 <= r["precision"] <= 1
        for score in ("fid", "fd_judge"):
            low, high = r["intervals"][score]
            assert low <= r[score] <= high
        assert 0 < r["guided_nfe"] < r["nfe"] and r["guided_nfe"] + r["unguided_nfe"] == r["nfe"]
    assert rows[0]["sampling_tflop_per_1000"] == pytest.approx(rows[1]["sampling_tflop_per_1000"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    code, _, err = run_face("scripts/sampling_study.py", argv, capsys)
    assert code == 0 and "2 settings done, 0 to run" in err
    assert json.loads(out.read_text())["rows"] == rows
    code, _, err = run_face("scripts/sampling_study.py", [*argv, "--seed", "1"], capsys)
    assert code == 2 and "holds a study of other settings" in err

    seed1 = tmp_path / "study_s1.json"
    argv1 = [*argv[:2], "--out", str(seed1), *argv[4:], "--seed", "1"]
    assert run_face("scripts/sampling_study.py", argv1, capsys)[0] == 0
    features = out.with_suffix(".features") / "ddim-5-g2-0.2_0.7.npz"
    assert np.load(features)["fd_judge"].shape[0] == 70
    verdicts = tmp_path / "verdicts.json"
    code, table, err = run_face("scripts/sampling_verdicts.py", ["--studies", str(out), str(seed1), "--baseline",
                                "ddim-5-g2-0.2:0.7", "--out", str(verdicts)], capsys)  # fmt: skip
    assert code == 0, err
    other = json.loads(verdicts.read_text())["rows"][1]
    assert other["verdict"] in ("better", "worse", "within noise") and set(other["shares_ahead"]) == {
        "fid",
        "fd_judge",
    }
    assert len(other["fid"]) == 2 and "| dpmpp-2m-5-g2-0.2:0.7 |" in table
    code, out_text, err = run_face("scripts/sample_count.py", ["--kept-features", str(features),
                                   str(seed1.with_suffix(".features") / features.name), "--counts", "66", "70"], capsys)  # fmt: skip
    assert code == 0, err
    assert "fd_judge n=70: 2 slices" in out_text

    # two recipes: the same settings sampled from another checkpoint, judged A against B
    other_ckpt = write_our_checkpoint(tmp_path / "other", None, seed=5, in_channels=1, input_size=28, patch_size=4)
    recipe_b = tmp_path / "recipe_b.json"
    argv_b = ["--ckpt", str(other_ckpt), "--out", str(recipe_b), *argv[4:]]
    assert run_face("scripts/sampling_study.py", argv_b, capsys)[0] == 0
    code, text, err = run_face(
        "scripts/sampling_verdicts.py", ["--studies", str(out), "--against", str(recipe_b)], capsys
    )
    assert code == 0, err
    assert text.count(": within noise") + text.count(": better") + text.count(": worse") == 2


def test_the_pareto_front_keeps_the_points_nothing_beats():
    from dit.cost.plots import pareto_front

    points = [(3, 4), (1, 5), (2, 3), (4, 1), (5, 2), (2, 6)]
    assert pareto_front(points) == [(1, 5), (2, 3), (4, 1)]


def test_a_file_that_is_no_study_is_one_error_line(tmp_path, capsys):
    """The verdicts and the sample count read files a user names: a missing or foreign one is one line."""
    foreign = tmp_path / "other.json"
    foreign.write_text("{}")
    for face, argv in (("scripts/sampling_verdicts.py", ["--studies", str(tmp_path / "missing.json")]),
                       ("scripts/sampling_verdicts.py", ["--studies", str(foreign)]),
                       ("scripts/sample_count.py", ["--kept-features", str(tmp_path / "missing.npz")]),
                       ("scripts/sample_count.py", ["--kept-features", str(foreign)])):  # fmt: skip
        code, _, err = run_face(face, argv, capsys)
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
