"""The dit-cost command line: JSON contracts, tables, errors as one line with exit code 2, and charts."""

import json

import pytest

from dit.cost.__main__ import main
from dit.model.config import model_names


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_flops_json_has_the_issue_keys(capsys):
    code, out, _ = run(capsys, "flops", "--model", "DiT-XL/2", "--image-size", "256", "--json")
    got = json.loads(out)
    assert code == 0
    for key in (
        "model",
        "image_size",
        "tokens",
        "params",
        "forward_gmacs",
        "forward_gflops",
        "train_gflops_per_image",
        "components",
    ):
        assert key in got
    assert (got["model"], got["image_size"], got["tokens"], got["params"]) == ("DiT-XL/2", 256, 256, 675129632)
    assert got["forward_gflops"] == 2 * got["forward_gmacs"]
    assert got["train_gflops_per_image"] == pytest.approx(3 * got["forward_gflops"])
    assert sum(got["components"].values()) == pytest.approx(got["forward_gmacs"])


def test_flops_all_is_a_list_over_the_registry(capsys):
    code, out, _ = run(capsys, "flops", "--all", "--image-size", "512", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["model"] for r in rows] == list(model_names())
    assert all(r["image_size"] == 512 and r["latent_size"] == 64 for r in rows)


def test_flops_tables_and_measure(capsys):
    code, out, _ = run(capsys, "flops", "--model", "DiT-S/8", "--measure", "--activation-checkpointing", "all")
    assert code == 0 and "attention_scores" in out and "FlopCounterMode on meta" in out and "6*N*T" in out
    code, out, _ = run(capsys, "flops", "--all")
    assert code == 0 and all(name in out for name in model_names())


def test_custom_pixel_model(capsys):
    code, out, _ = run(
        capsys,
        "flops",
        "--vae",
        "none",
        "--image-size",
        "32",
        "--depth",
        "6",
        "--hidden-size",
        "256",
        "--num-heads",
        "4",
        "--patch-size",
        "2",
        "--num-classes",
        "10",
        "--json",
    )
    got = json.loads(out)
    assert code == 0 and (got["model"], got["in_channels"], got["tokens"]) == ("custom", 3, 256)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["flops", "--model", "DiT-Q/3"], "DiT-XL/2"),
        (["flops", "--depth", "0"], "--depth"),
        (["flops", "--model", "DiT-S/2", "--image-size", "250"], "--image-size"),
        (["flops", "--model", "DiT-S/2", "--activation-checkpointing", "40"], "--activation-checkpointing"),
        (
            [
                "train",
                "--model",
                "DiT-S/2",
                "--global-batch-size",
                "8",
                "--max-steps",
                "10",
                "--gpu",
                "Imaginary X9000",
                "--mfu",
                "0.4",
            ],
            "--peak-tflops",
        ),
        (
            [
                "train",
                "--model",
                "DiT-S/2",
                "--global-batch-size",
                "-8",
                "--max-steps",
                "10",
                "--gpu",
                "A100",
                "--mfu",
                "0.4",
            ],
            "--global-batch-size",
        ),
        (["memory", "--model", "DiT-S/2"], "--batch-per-device"),
        (["memory", "--model", "DiT-S/2", "--batch-per-device", "8", "--gpu", "A100"], "--memory-gib"),
        (["peaks", "--device", "H100-SXM", "--peak-tflops", "-3"], "--peak-tflops"),
        (
            [
                "memory",
                "--model",
                "DiT-S/2",
                "--batch-per-device",
                "8",
                "--gpu",
                "A100-80GB",
                "--memory-reserve-gib",
                "-1",
            ],
            "--memory-reserve-gib",
        ),
        (
            ["sample", "--model", "DiT-S/2", "--gpu", "A100", "--mfu", "0.3", "--num-sampling-steps", "0"],
            "--num-sampling-steps",
        ),
        (["sample", "--model", "DiT-S/2", "--cfg-scale", "0.5"], "--guidance-scale (--cfg-scale) must be >= 1"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.startswith("error: ") and needle in err and "Traceback" not in err


def test_sample_command(capsys):
    code, out, _ = run(
        capsys,
        "sample",
        "--model",
        "DiT-XL/2",
        "--num-images",
        "1000",
        "--num-sampling-steps",
        "50",
        "--cfg-scale",
        "4.0",
        "--gpu",
        "A100",
        "--mfu",
        "0.3",
        "--price-per-hour",
        "2",
        "--json",
    )
    got = json.loads(out)
    assert code == 0 and got["forward_passes_per_image"] == 100 and got["cost"] > 0


def test_memory_command(capsys):
    code, out, _ = run(
        capsys,
        "memory",
        "--model",
        "DiT-XL/2",
        "--global-batch-size",
        "256",
        "--num-gpus",
        "8",
        "--gpu",
        "NVIDIA H100 80GB HBM3",
        "--json",
    )
    got = json.loads(out)
    assert code == 0 and got["batch_per_device"] == 32 and got["max_batch_per_device"] > 32
    code, out, _ = run(capsys, "memory", "--model", "DiT-S/2", "--batch-per-device", "8", "--trace")
    assert code == 0 and "traced peak" in out and "analytic/traced" in out


def test_peaks_command(capsys):
    code, out, _ = run(capsys, "peaks")
    assert code == 0 and "L40S" in out and "MI250X" in out
    code, out, _ = run(capsys, "peaks", "--device", "NVIDIA L40S", "--json")
    assert json.loads(out) == {"device": "L40S", "precision": "bf16", "tflops": 362.0, "source": "table"}
    from dit.cost.devices import find_device

    # fp8: a column of the table though no run precision (it raised a KeyError from the runtime's policy)
    code, out, _ = run(capsys, "peaks", "H100-SXM", "--precision", "fp8", "--json")
    assert code == 0 and json.loads(out)["tflops"] == find_device("H100-SXM").fp8


def test_peaks_of_one_device_named_as_an_argument_or_a_flag(capsys, monkeypatch):
    """`dit-cost peaks cpu` measures (its --help says so; the argument was refused); a device this machine
    lacks is one line, not the CPU measured under the device's name."""
    from dit.cost import peaks

    monkeypatch.setattr(
        peaks, "cpu_peak", lambda precision, seconds=1.0: peaks.Peak(2e12, "measured", "cpu", precision)
    )
    for argv in (["peaks", "cpu"], ["peaks", "--gpu", "cpu"], ["peaks", "cpu", "--device", "cpu"]):
        code, out, _ = run(capsys, *argv, "--precision", "fp32")
        assert code == 0 and out == "peak: 2 TFLOP/s fp32 on cpu (measured)\n", (argv, out)
    code, out, _ = run(capsys, "peaks", "L40S", "--json")
    assert code == 0 and json.loads(out)["tflops"] == 362.0
    monkeypatch.setattr(peaks, "device_name", lambda device=None: "cpu")
    for argv in (
        ["peaks", "--gpu", "Imaginary X9000"],
        ["peaks", "Imaginary X9000"],
        ["peaks", "cpu", "--gpu", "L4"],
    ):
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), (argv, err)


def test_plots_are_png(capsys, tmp_path):
    flops_png, memory_png = tmp_path / "flops.png", tmp_path / "memory.png"
    assert run(capsys, "plot", "flops", "--out", str(flops_png))[0] == 0
    assert (
        run(capsys, "plot", "memory", "--model", "DiT-XL/2", "--gpu", "H100-SXM", "--out", str(memory_png))[0] == 0
    )
    for png in (flops_png, memory_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cost_cli_answers_without_loading_torch():
    """Planning is a host-side calculation: `dit-cost flops/train/sample` must not pay torch's import."""
    import subprocess
    import sys

    code = "import sys; sys.argv = ['dit-cost', 'flops', '--all', '--json']; "
    code += (
        "import dit.cost.__main__ as m; m.main(sys.argv[1:]); assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
