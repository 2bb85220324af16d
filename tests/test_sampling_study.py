"""studies/sampling_study.py on a tiny digit-shaped model: two settings scored by both judges, the chart drawn, a
rerun resumed; its kept features judged by studies/sampling_verdicts.py and measured by studies/sample_count.py."""

from __future__ import annotations

import json
from pathlib import Path

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
    code, _, err = run_face("studies/sampling_study.py", argv, capsys)
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

    code, _, err = run_face("studies/sampling_study.py", argv, capsys)
    assert code == 0 and "2 settings done, 0 to run" in err
    assert json.loads(out.read_text())["rows"] == rows
    code, _, err = run_face("studies/sampling_study.py", [*argv, "--seed", "1"], capsys)
    assert code == 2 and "holds a study of other settings" in err
    study = json.loads(out.read_text())  # balanced by default, recorded in the study and in every row
    assert study["labels"] == "balanced" and {r["labels"] for r in rows} == {"balanced"}
    code, _, err = run_face("studies/sampling_study.py", [*argv, "--labels", "random"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "made with balanced labels, not random" in err

    seed1 = tmp_path / "study_s1.json"
    argv1 = [*argv[:2], "--out", str(seed1), *argv[4:], "--seed", "1"]
    assert run_face("studies/sampling_study.py", argv1, capsys)[0] == 0
    features = out.with_suffix(".features") / "ddim-5-g2-0.2_0.7.npz"
    assert np.load(features)["fd_judge"].shape[0] == 70
    verdicts = tmp_path / "verdicts.json"
    code, table, err = run_face("studies/sampling_verdicts.py", ["--studies", str(out), str(seed1), "--baseline",
                                "ddim-5-g2-0.2:0.7", "--out", str(verdicts)], capsys)  # fmt: skip
    assert code == 0, err
    other = json.loads(verdicts.read_text())["rows"][1]
    assert other["verdict"] in ("better", "worse", "within noise") and set(other["shares_ahead"]) == {
        "fid",
        "fd_judge",
    }
    assert len(other["fid"]) == 2 and "| dpmpp-2m-5-g2-0.2:0.7 |" in table
    code, out_text, err = run_face("studies/sample_count.py", ["--kept-features", str(features),
                                   str(seed1.with_suffix(".features") / features.name), "--counts", "66", "70"], capsys)  # fmt: skip
    assert code == 0, err
    assert "fd_judge n=70: 2 slices" in out_text

    # two recipes: the same settings sampled from another checkpoint, judged A against B
    other_ckpt = write_our_checkpoint(tmp_path / "other", None, seed=5, in_channels=1, input_size=28, patch_size=4)
    recipe_b = tmp_path / "recipe_b.json"
    argv_b = ["--ckpt", str(other_ckpt), "--out", str(recipe_b), *argv[4:]]
    assert run_face("studies/sampling_study.py", argv_b, capsys)[0] == 0
    code, text, err = run_face(
        "studies/sampling_verdicts.py", ["--studies", str(out), "--against", str(recipe_b)], capsys
    )
    assert code == 0, err
    assert text.count(": within noise") + text.count(": better") + text.count(": worse") == 2


def test_the_pareto_front_keeps_the_points_nothing_beats():
    from helpers import face

    pareto_front = face("studies/sampling_study.py").pareto_front
    points = [(3, 4), (1, 5), (2, 3), (4, 1), (5, 2), (2, 6)]
    assert pareto_front(points) == [(1, 5), (2, 3), (4, 1)]


def test_a_file_that_is_no_study_is_one_error_line(tmp_path, capsys):
    """The verdicts and the sample count read files a user names: a missing or foreign one is one line."""
    foreign = tmp_path / "other.json"
    foreign.write_text("{}")
    for face, argv in (("studies/sampling_verdicts.py", ["--studies", str(tmp_path / "missing.json")]),
                       ("studies/sampling_verdicts.py", ["--studies", str(foreign)]),
                       ("studies/sample_count.py", ["--kept-features", str(tmp_path / "missing.npz")]),
                       ("studies/sample_count.py", ["--kept-features", str(foreign)])):  # fmt: skip
        code, _, err = run_face(face, argv, capsys)
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


ROW = {"sampler": "ddim", "steps": 5, "guidance_scale": 1, "interval": "all", "fid": 9.0, "fd_judge": 0.5,
       "intervals": {"fid": [8, 10], "fd_judge": [0.4, 0.6]}, "sampling_tflop_per_1000": 1.0}  # fmt: skip


def _features():
    """Both judges' kept features of 70 samples, 64 wide as the digit networks' are."""
    return {s: np.random.default_rng(0).standard_normal((70, 64)).astype(np.float32) for s in ("fid", "fd_judge")}


def _studies(tmp_path, rows=(ROW,), features=None):
    """Two seeds' study JSONs as studies/sampling_study.py writes them, each with one setting's kept features
    beside it; the first seed's with ``rows`` and ``features``. Returns their paths and the first's features."""
    paths = []
    for seed, (r, f) in enumerate(((list(rows), features or _features()), ([ROW], _features()))):
        path = tmp_path / f"study_s{seed}.json"
        path.write_text(json.dumps({"ckpt_sha256": "0" * 64, "num_samples": 70, "seed": seed,
                                    "feature_networks": ["digits", "judge"], "rows": r}))  # fmt: skip
        path.with_suffix(".features").mkdir()
        np.savez(path.with_suffix(".features") / "ddim-5-g1-all.npz", **f)
        paths.append(str(path))
    return paths, tmp_path / "study_s0.features" / "ddim-5-g1-all.npz"


def test_the_foreign_file_fixture_is_judged_as_written(tmp_path, capsys):
    """The cases below start from these files, untouched: each fails for the change it makes, not the rest."""
    studies, kept = _studies(tmp_path)
    argv = ["--studies", *studies, "--baseline", "ddim-5-g1-all"]
    code, _, err = run_face("studies/sampling_verdicts.py", argv, capsys)
    assert code == 0, err
    argv = ["--kept-features", str(kept), "--counts", "66", "70"]
    code, out, err = run_face("studies/sample_count.py", argv, capsys)
    assert code == 0 and "fd_judge n=70: 1 slices" in out, err


@pytest.mark.parametrize(
    "case", ["object array", "no judge key", "another width", "truncated", "npy", "nan", "row without a sampler"]
)
def test_foreign_kept_features_or_rows_are_one_error_line(tmp_path, capsys, case):
    """Files the verdicts and the sample count read, as another tool or a cut copy leaves them: one line, each."""
    good, rows = _features(), [ROW]
    features = dict(good)
    if case == "object array":
        features["fd_judge"] = np.array([{"a": 1}] * 70, dtype=object)
    elif case == "no judge key":
        del features["fd_judge"]
    elif case == "another width":
        features["fid"] = good["fid"][:, :32]
    elif case == "nan":
        features["fid"] = good["fid"].copy()
        features["fid"][3, 5] = np.nan
    elif case == "row without a sampler":
        rows = [{k: v for k, v in ROW.items() if k != "sampler"}]
    studies, kept = _studies(tmp_path, rows, features)
    if case == "truncated":
        kept.write_bytes(kept.read_bytes()[: kept.stat().st_size // 2])
    elif case == "npy":
        np.save(kept.with_suffix(".npy"), good["fid"])
        kept.unlink()
        kept = kept.with_suffix(".npy")
    faces = [("studies/sampling_verdicts.py", ["--studies", *studies, "--baseline", "ddim-5-g1-all"])]
    if case != "row without a sampler":
        faces.append(("studies/sample_count.py", ["--kept-features", str(kept), "--counts", "66"]))
    for face, argv in faces:
        code, _, err = run_face(face, argv, capsys)
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, (face, err)


def test_a_study_out_that_is_cut_short_is_one_error_line(tmp_path, capsys):
    """A rerun reads its --out to resume: a truncated or foreign one is one line, not a JSONDecodeError."""
    ckpt = write_our_checkpoint(tmp_path, None, in_channels=1, input_size=28, patch_size=4)
    out = tmp_path / "study.json"
    for text in ('{"rows": [', "[1, 2]"):
        out.write_text(text)
        argv = ["--ckpt", str(ckpt), "--out", str(out), "--samplers", "ddim", "--nfe", "5", "--num-samples", "70"]
        code, _, err = run_face("studies/sampling_study.py", argv, capsys)
        assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err


def test_verdicts_refuse_studies_of_two_label_modes(tmp_path, capsys):
    """A study without a label mode drew random labels: judged against a balanced one, the pairs would mix."""
    paths, _ = _studies(tmp_path)
    second = json.loads(Path(paths[1]).read_text())
    Path(paths[1]).write_text(json.dumps({**second, "labels": "balanced"}))
    code, _, err = run_face(
        "studies/sampling_verdicts.py", ["--studies", *paths, "--baseline", "ddim-5-g1-all"], capsys
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "the labels (balanced or random)" in err
    Path(paths[0]).write_text(json.dumps({**json.loads(Path(paths[0]).read_text()), "labels": "balanced"}))
    assert (
        run_face("studies/sampling_verdicts.py", ["--studies", *paths, "--baseline", "ddim-5-g1-all"], capsys)[0]
        == 0
    )
