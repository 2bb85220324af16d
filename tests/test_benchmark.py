"""scripts/benchmark.py writes what it claims: rows with timings, a calibration dit-cost accepts."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from dit.cost.plan import load_calibration

REPO = Path(__file__).resolve().parents[1]


def bench(*args):
    # A guard against a hang, not a speed check: with ATen's unvectorised kernels on a loaded 2-core machine one
    # DiT-S/8 step took 24 s and the train mode ran past 300 s.
    out = subprocess.run(
        [sys.executable, "scripts/benchmark.py", *args], cwd=REPO, capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr
    return out


def test_train_rows_and_calibration(tmp_path):
    rows_file, cal_file = tmp_path / "rows.json", tmp_path / "cal.json"
    common = ["--model", "DiT-S/8", "--image-size", "64", "--global-batch-size", "4", "--timed-steps", "2"]
    # A given peak: one measured while the machine is busier than during the steps can put every MFU above 1.
    common += ["--untimed-steps", "1", "--peak-tflops", "1000"]
    bench("train", *common, "--precision", "fp32", "bf16", "--out", str(rows_file), "--calibration", str(cal_file))
    data = json.loads(rows_file.read_text())
    assert {(r["precision"], r["attention"]) for r in data["rows"]} == {("fp32", "sdpa"), ("bf16", "explicit")}
    for r in data["rows"]:
        assert r["samples"] == 2 and r["p10_s"] <= r["median_s"] <= r["p90_s"]
        assert r["images_per_sec"] == pytest.approx(4 / r["median_s"])
        assert r["mfu"] == pytest.approx(r["model_tflops"] / r["peak_tflops"])
        assert len(r["losses"]) == 3
        during = r["matmul_peak_tflops_during"]  # probed between the paired steps
        assert r["fraction_of_fp32_matmul_peak"] == pytest.approx(r["model_tflops"] / during["fp32"])
    fp32, bf16 = sorted(data["rows"], key=lambda r: r["precision"] != "fp32")
    assert bf16["speedup_vs_fp32"] == pytest.approx(fp32["median_s"] / bf16["median_s"])
    assert set(data["matmul_peak_tflops"]) == {"fp32", "bf16"}
    cal = load_calibration(str(cal_file))
    best = max((r for r in data["rows"] if r["mfu"] <= 1), key=lambda r: r["mfu"])  # above 1: the peak is wrong
    assert (cal.model, cal.precision, cal.mfu) == ("DiT-S/8", best["precision"], best["mfu"])


def test_reader_and_accounting_modes(tmp_path):
    out = bench(
        "reader", "--num-images", "600", "--seconds", "0.3", "--repeats", "1", "--out", str(tmp_path / "r.json")
    )
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert row["items"] == 600 and row["best_samples_per_sec"] > 0
    assert "best_samples_per_sec" in out.stdout
    bench(
        "accounting",
        "--model",
        "DiT-S/8",
        "--image-size",
        "64",
        "--global-batch-size",
        "4",
        "--out",
        str(tmp_path / "a.json"),
    )
    acc = json.loads((tmp_path / "a.json").read_text())["rows"][0]
    assert acc["meter_step_us"] > 0 and acc["overhead_frac"] > 0  # a fraction of a timed step: no bound load holds
    assert acc["overhead_frac"] == pytest.approx(acc["overhead_per_step_us"] / 1e6 / acc["step_median_s"])


def test_loss_curves_compare_precisions_with_seed_noise(tmp_path):
    from test_train import Pixels, tiny_config

    from dit.bench.steps import bench_loss_curves

    base = tiny_config(tmp_path, max_steps=6, log_every=2, precision="fp32")
    result = bench_loss_curves(base, Pixels(), tail=0.5)
    curves = result["curves"]
    assert set(curves) == {"fp32 seed 0", "bf16 seed 0", "fp32 seed 1"}
    assert all([step for step, _ in c] == [2, 4, 6] for c in curves.values())
    assert curves["bf16 seed 0"] != curves["fp32 seed 0"] != curves["fp32 seed 1"]
    ref = statistics.fmean(loss for _, loss in curves["fp32 seed 0"][-2:])
    bf16 = statistics.fmean(loss for _, loss in curves["bf16 seed 0"][-2:])
    assert result["tail_gap_to_reference"]["bf16 seed 0"] == pytest.approx(bf16 / ref - 1)
    assert result["seed_noise"] == pytest.approx(abs(result["tail_gap_to_reference"]["fp32 seed 1"]))


def test_profile_and_attention_modes(tmp_path):
    common = ["--model", "DiT-S/8", "--image-size", "64", "--global-batch-size", "2"]
    # Every op's row: the table is ordered by time, which the machine's load reorders, so no top N is asserted.
    table = bench("profile", *common, "--rows", "1000").stdout
    assert "Input Shapes" in table.splitlines()[1] and "Self CPU time total" in table
    assert "aten::addmm" in table and "AddmmBackward0" in table  # the linear layers, forward and backward
    rows_file = tmp_path / "attn.json"
    bench("attention", *common, "--precision", "bf16", "--attention", "auto", "flash", "--out", str(rows_file))
    rows = json.loads(rows_file.read_text())["rows"]
    assert [r["attention"] for r in rows] == ["explicit", "flash"]  # auto resolves to explicit for bf16 on CPU
    assert all(0 < r["p10_s"] <= r["median_s"] <= r["p90_s"] for r in rows)


def test_precision_mode_scores_each_run(tmp_path):
    rows_file = tmp_path / "p.json"
    bench("precision", "--max-steps", "2", "--seeds", "0", "--eval-samples", "70", "--out", str(rows_file))
    rows = json.loads(rows_file.read_text())["rows"]
    assert [(r["precision"], r["seed"]) for r in rows] == [("fp32", 0), ("bf16", 0)]
    assert all(r["fid"] > 0 and 0 <= r["class_accuracy"] <= 1 and r["steps"] == 2 for r in rows)


@pytest.mark.slow
def test_repeat_mode_runs_the_quick_start_with_in_loop_evaluations(tmp_path):
    bench("repeat", "--repeats", "1", "--max-steps", "20", "--peak", "cached", "--eval-every", "10",
          "--out", str(tmp_path / "r.json"))  # fmt: skip
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert row["evaluations"] == 2 and row["steps"] == 20
    assert row["mfu"] > 0 and row["peak_tflops"] > 0  # no upper bound: the peak and the steps saw other loads


def test_train_skips_a_configuration_that_does_not_fit_and_says_why(tmp_path):
    from dit.cost.memory import estimate_training_memory
    from dit.model.config import model_config

    rows_file = tmp_path / "rows.json"
    argv = ["--model", "DiT-XL/2", "--global-batch-size", "256", "--precision", "bf16", "--attention", "sdpa"]
    out = bench("train", *argv, "--peak-probe", "0", "--memory-gib", "80", "--out", str(rows_file))  # an H100
    data = json.loads(rows_file.read_text())
    (row,) = data["rows"]
    assert data["complete"] and "median_s" not in row  # no step was run
    need = estimate_training_memory(model_config("DiT-XL/2"), 256, "bf16").total / 2**30
    assert need > 72  # the 80 GiB less 10% kept free
    assert (
        row["skipped"].startswith(f"dit-cost memory estimates {need:.1f} GiB")
        and "72.0 GiB usable" in row["skipped"]
    )
    assert "skipped: dit-cost memory estimates" in out.stderr


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["sample", "--cfg-scale", "0.5"], "--guidance-scale (--cfg-scale) must be >= 1"),
        (["sample", "--peak-tflops", "0"], "--peak-tflops must be > 0"),
        (["train", "--peak-tflops", "-1"], "--peak-tflops must be > 0"),
    ],
)
def test_a_bad_bound_is_one_line_before_any_run(argv, needle, capsys):
    """The bounds live at the fields, as in train.py and dit-cost: nothing downstream checks them again."""
    from helpers import run_face

    code, _, err = run_face("scripts/benchmark.py", argv, capsys)
    assert code == 2 and err.startswith(f"error: {needle}") and err.count("\n") == 1, err
