"""The after-training study's aggregator (studies/after_training.py, issue 39 item 4) on synthetic studies: each
method's best setting, its verdicts against the default and, for autoguidance, against CFG's best, and the
steps that give a smaller guide CFG's sampling FLOPs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import face, run_face, write_our_checkpoint

REFS = {"fid": (np.zeros(4), np.eye(4)), "fd_judge": (np.zeros(3), np.eye(3))}
N = 200


@pytest.fixture
def after():
    return face("studies/after_training.py")


def _study(folder: Path, name: str, settings: dict, labels: str = "balanced") -> list[str]:
    """One study per training seed, as studies/sampling_study.py writes them: each setting (name: shift of its
    features from the reference) with its scores (the shift, a little worse on seed 1) and kept features."""
    paths = []
    for seed in (0, 1):
        path = folder / f"{name}-s{seed}.json"
        rows = []
        for i, (setting, (shift, tflop)) in enumerate(settings.items()):
            sampler, steps, scale, interval = setting.split("-")
            score = shift + 0.01 * seed
            rows.append({"sampler": sampler, "steps": int(steps), "guidance_scale": float(scale[1:]),
                         "interval": interval, "fid": score, "fd_judge": score, "labels": labels,
                         "intervals": {"fid": [score - 0.1, score + 0.1], "fd_judge": [score - 0.1, score + 0.1]},
                         "sampling_tflop_per_1000": tflop})  # fmt: skip
            rng = np.random.default_rng([len(name), seed, i, sum(map(ord, name))])
            path.with_suffix(".features").mkdir(exist_ok=True)
            np.savez(path.with_suffix(".features") / f"{setting}.npz",
                     **{k: rng.normal(size=(N, len(mu))) + shift for k, (mu, _) in REFS.items()})  # fmt: skip
        path.write_text(json.dumps({"ckpt_sha256": f"{name}-{seed}", "num_samples": N, "seed": 0, "labels": labels,
                                    "feature_networks": ["digits", "judge"], "rows": rows}))  # fmt: skip
        paths.append(str(path))
    return paths


def test_each_method_is_judged_at_its_best_setting_against_the_default_and_cfg(after, tmp_path):
    default = _study(tmp_path, "classic", {"ddim-10-g1.5-all": (1.0, 2.5), "ddim-10-g2-all": (0.6, 2.5)})
    methods = {
        "posthoc_ema": {
            f"sigma_rel {s}": _study(tmp_path, f"ema{s}", {"ddim-10-g1.5-all": (shift, 2.5)})
            for s, shift in ((0.05, 0.9), (0.1, 0.2), (0.2, 1.4))
        },  # fmt: skip
        "cfg": {"classic EMA": default},
        "autoguidance_early": {
            "early": _study(tmp_path, "early", {"ddim-10-g2-all": (0.6, 2.5), "ddim-10-g3-all": (0.8, 2.5)})
        },  # fmt: skip
        "random_labels": {"random": _study(tmp_path, "random", {"ddim-10-g1.5-all": (1.0, 2.5)}, "random")},
    }
    out = after.aggregate({"studies": default, "setting": "ddim-10-g1.5-all"}, methods, REFS)
    assert out["default"]["fid"] == pytest.approx([1.0, 1.01]) and out["default"]["labels"] == "balanced"
    ema = out["methods"]["posthoc_ema"]
    assert ema["best"]["study"] == "sigma_rel 0.1" and len(ema["candidates"]) == 3
    assert ema["verdicts"]["default"]["verdict"] == "better" and ema["fd_judge"] == pytest.approx([0.2, 0.21])
    assert ema["tflop_per_1000"] == 2.5 and len(ema["fid_intervals"]) == 2
    cfg = out["methods"]["cfg"]
    assert cfg["best"]["setting"] == "ddim-10-g2-all" and cfg["verdicts"]["default"]["verdict"] == "better"
    auto = out["methods"]["autoguidance_early"]
    assert auto["best"]["setting"] == "ddim-10-g2-all"
    assert auto["verdicts"]["default"]["verdict"] == "better"  # ahead of the default,
    assert auto["verdicts"]["cfg"]["verdict"] == "within noise"  # not of CFG at its best scale
    random = out["methods"]["random_labels"]
    assert random["labels"] == "random" and random["verdicts"]["default"]["verdict"] == "within noise"


def test_a_smaller_guide_gets_the_steps_that_stay_within_cfgs_flops(after):
    assert after.equal_flops_steps(10, 1.0, 1.0) == 10  # an early checkpoint costs what CFG's pass costs
    steps = after.equal_flops_steps(10, 2.6, 1.0)
    assert steps == 14 and steps * (2.6 + 1.0) <= 10 * 2 * 2.6 < (steps + 1) * (2.6 + 1.0)


@pytest.mark.parametrize("case", ["no checkpoints", "no early checkpoint"])
def test_a_run_the_study_cannot_use_is_one_line_before_any_sampling(after, tmp_path, capsys, case):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if case == "no early checkpoint":
        write_our_checkpoint(run / "checkpoints", None)  # the final step alone: nothing earlier to guide with
    code, _, err = run_face("studies/after_training.py", ["--runs", str(run), "--work", str(tmp_path / "w"),
                            "--out", str(tmp_path / "v.json")], capsys)  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error:"), err
    assert ("has no checkpoints" if case == "no checkpoints" else "keeps no early checkpoint") in err
    assert not (tmp_path / "v.json").exists() and not list((tmp_path / "w").iterdir())
