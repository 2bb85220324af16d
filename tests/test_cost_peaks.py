"""Device-name matching on the real name strings, dtype columns, overrides and the measured fallback."""

import pytest
import torch

from dit.cost.peaks import (
    DEVICES,
    KNOWN_DEVICES,
    PEAK_ENV,
    device_memory_bytes,
    find_device,
    matmul_precision,
    measure_matmul_peak,
    resolve_peak,
    table_peak,
)
from dit.io.errors import UserError

# torch.cuda.get_device_name() strings seen in public code (../shared/research/accounting.md, 3.3).
REAL_NAMES = {
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA A100-SXM4-40GB": "A100",
    "NVIDIA A100-PCIE-40GB": "A100",
    "NVIDIA A100 80GB PCIe": "A100",
    "NVIDIA A800-SXM4-80GB": "A800",
    "NVIDIA A800 80GB PCIe": "A800",
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H800": "H800 SXM",
    "NVIDIA H800 PCIe": "H800 PCIe",
    "NVIDIA H200": "H200 SXM",
    "NVIDIA H200 NVL": "H200 NVL",
    "NVIDIA GH200 480GB": "GH200",
    "NVIDIA B200": "B200",
    "NVIDIA GB200": "GB200",
    "NVIDIA H20": "H20",
    "NVIDIA L4": "L4",
    "NVIDIA L40": "L40",
    "NVIDIA L40S": "L40S",
    "NVIDIA A10": "A10",
    "NVIDIA A10G": "A10G",
    "NVIDIA GeForce RTX 3090": "RTX 3090",
    "NVIDIA GeForce RTX 4090": "RTX 4090",
    "NVIDIA GeForce RTX 5090": "RTX 5090",
    "Tesla V100-SXM2-16GB": "V100 SXM2",
    "Tesla V100-SXM2-32GB": "V100 SXM2",
    "Tesla V100-PCIE-16GB": "V100 PCIe",
    "Tesla V100-PCIE-32GB": "V100 PCIe",
    "Tesla V100S-PCIE-32GB": "V100S PCIe",
    "Tesla T4": "T4",
    "AMD Instinct MI250X/MI250": "MI250X",
    "AMD Instinct MI300X": "MI300X",
    "AMD Instinct MI325X": "MI325X",
}


@pytest.mark.parametrize("name,expected", REAL_NAMES.items())
def test_real_device_names_match_the_right_row(name, expected):
    assert find_device(name).name == expected


@pytest.mark.parametrize(
    "name,expected",
    [
        ("nvidia l40s", "L40S"),
        ("H100-SXM", "H100 SXM"),
        ("h100_pcie", "H100 PCIe"),
        ("TPU-v3", "TPU v3"),
        ("a100", "A100"),
        ("MI250", "MI250"),
    ],
)
def test_aliases_and_case(name, expected):
    assert find_device(name).name == expected


@pytest.mark.parametrize(
    "name",
    ["NVIDIA H800 NVL", "NVIDIA GeForce RTX 4090 D", "NVIDIA RTX A6000", "Intel Data Center GPU Max", "cpu"],
)
def test_unlisted_devices_are_unknown_not_a_near_miss(name):
    assert find_device(name) is None


def test_substring_traps_get_distinct_peaks():
    bf16 = {n: table_peak(n, "bf16").flops / 1e12 for n in ("NVIDIA L40S", "NVIDIA L40", "NVIDIA L4")}
    assert bf16 == {"NVIDIA L40S": 362, "NVIDIA L40": 181, "NVIDIA L4": 121}
    assert table_peak("NVIDIA H20", "bf16").flops < 0.2 * table_peak("NVIDIA H200", "bf16").flops
    assert table_peak("NVIDIA H100 NVL", "bf16").flops < table_peak("NVIDIA H100 80GB HBM3", "bf16").flops
    assert table_peak("NVIDIA H100 PCIe", "bf16").flops < table_peak("NVIDIA H100 NVL", "bf16").flops
    # MI250X: one torch device is one GCD, half the per-OAM datasheet figure
    assert table_peak("AMD Instinct MI250X/MI250", "bf16").flops == 191.5e12


def test_dtype_columns():
    assert table_peak("NVIDIA A100-SXM4-80GB", "tf32").flops == 156e12  # the official DiT recipe's peak
    assert table_peak("NVIDIA A100-SXM4-80GB", "fp32").flops == 19.5e12
    assert table_peak("NVIDIA H100 80GB HBM3", "fp8").flops == pytest.approx(
        2 * table_peak("NVIDIA H100 80GB HBM3", "bf16").flops, rel=1e-3
    )
    # no TF32 units before Ampere: fp32 matmuls run at the fp32 rate
    assert table_peak("Tesla V100-SXM2-16GB", "tf32").flops == table_peak("Tesla V100-SXM2-16GB", "fp32").flops
    with pytest.raises(UserError, match="no published dense bf16.*--peak-tflops"):
        table_peak("Tesla V100-SXM2-16GB", "bf16")
    with pytest.raises(UserError, match="A10G.*--peak-tflops"):
        table_peak("NVIDIA A10G", "bf16")
    with pytest.raises(UserError, match="no published dense int8 rate.*--peak-tflops"):  # a dtype with no column
        table_peak("NVIDIA H100 80GB HBM3", "int8")


def test_table_rows_are_consistent():
    for d in DEVICES:
        for low, high in (("fp32", "tf32"), ("tf32", "bf16"), ("bf16", "fp8")):
            a, b = getattr(d, low), getattr(d, high)
            assert a is None or b is None or a <= b, (d.name, low, high)
    assert len(set(KNOWN_DEVICES)) == len(KNOWN_DEVICES)


def test_unknown_device_error_lists_names_and_the_override():
    with pytest.raises(UserError) as err:
        table_peak("Imaginary X9000", "bf16")
    assert "H100 SXM" in str(err.value) and "L40S" in str(err.value) and "--peak-tflops" in str(err.value)


def test_override_and_environment_win(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert resolve_peak("NVIDIA H100 80GB HBM3", "bf16", override_tflops=700).flops == 700e12
    monkeypatch.setenv(PEAK_ENV, "650")
    peak = resolve_peak("NVIDIA H100 80GB HBM3", "bf16")
    assert (peak.flops, peak.source) == (650e12, f"env {PEAK_ENV}")
    assert resolve_peak("NVIDIA H100 80GB HBM3", "bf16", override_tflops=700).source == "override"
    monkeypatch.setenv(PEAK_ENV, "fast")
    with pytest.raises(UserError, match=PEAK_ENV):
        resolve_peak("NVIDIA H100 80GB HBM3", "bf16")


def test_cpu_and_unknown_devices_are_measured_never_an_a100_guess(monkeypatch):
    from dit.cost import peaks

    monkeypatch.delenv(PEAK_ENV, raising=False)
    cpu = resolve_peak(None, "fp32", measure_seconds=0.05)
    assert cpu.source == "measured" and cpu.device == "cpu" and cpu.flops > 0
    # a device this machine lacks cannot be measured here: refused, not the CPU under its name
    monkeypatch.setattr(peaks, "device_name", lambda device=None: "cpu")
    for name, words in (("Imaginary X9000", ("known devices", "H100 SXM")), ("NVIDIA A10G", ("A10G has no",))):
        with pytest.raises(UserError) as err:
            resolve_peak(name, "bf16")
        assert all(w in str(err.value) for w in (*words, "it has cpu", "--peak-tflops")), err.value
    monkeypatch.setattr(peaks, "device_name", lambda device=None: "NVIDIA Imaginary X9000")  # present: measured
    with pytest.warns(UserWarning, match="--peak-tflops"):
        unknown = resolve_peak("Imaginary X9000", "fp32", measure_seconds=0.05)
    assert unknown.source == "measured" and "Imaginary X9000" in unknown.device
    assert unknown.flops != table_peak("NVIDIA A100-SXM4-80GB", "fp32").flops
    monkeypatch.setattr(peaks, "device_name", lambda device=None: "NVIDIA A10G")
    with pytest.warns(UserWarning, match="bf16"):  # a known device without that rate: measured, not a crash
        assert resolve_peak("NVIDIA A10G", "bf16", measure_seconds=0.05).source == "measured"
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16").source == "table"


def _fake_probes(monkeypatch, rounds):
    """measure_matmul_peak replaced by the given rounds of probe results (TFLOP/s), in order; records calls."""
    from dit.cost import peaks

    calls, queue = [], list(rounds)

    def probes(precision, seconds, device, probes):
        calls.append((precision, probes))
        got = queue.pop(0)
        return [t * 1e12 for t in got[:probes]] + [min(got) * 1e12] * (probes - len(got))

    monkeypatch.setattr(peaks, "measure_matmul_peak", probes)
    return calls


def _age_cache(path, days):
    import datetime
    import json

    cache = json.loads(path.read_text())
    for entry in cache.values():
        entry["date"] = (datetime.date.today() - datetime.timedelta(days=days)).isoformat()
    path.write_text(json.dumps(cache))


def test_cpu_peak_is_the_best_of_several_probes_kept_per_machine(tmp_path, monkeypatch):
    """One probe per run let MFU follow the probe's noise; the best of several, kept with its date, does not."""
    from dit.cost import peaks

    monkeypatch.setenv("DIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(PEAK_ENV, raising=False)
    calls = _fake_probes(monkeypatch, [[1, 3, 2], [2.9, 1], [3, 1], [2.8, 2.9], [3, 3], [3, 3]])
    first = resolve_peak("cpu", "bf16")
    assert first.flops == 3e12 and calls == [("bf16", peaks.CPU_PEAK_PROBES)] * 2  # two rounds, the run's dtype
    assert "spread 1-3 TFLOP/s" in first.detail and f"kept in {tmp_path}" in first.detail
    assert first.measured_on and "0 days old" in first.describe() and "measured" in first.describe()
    again = resolve_peak("cpu", "bf16")  # from the file: no new probe, the same number
    assert again.flops == first.flops and len(calls) == 2
    assert resolve_peak("cpu", "fp32").flops == 3e12 and len(calls) == 4  # another dtype is its own entry
    _age_cache(tmp_path / "cpu_peaks.json", peaks.CPU_PEAK_MAX_AGE_DAYS + 1)
    resolve_peak("cpu", "bf16")
    assert len(calls) == 6  # an old measurement is taken again


def test_a_cpu_tf32_peak_is_the_fp32_peak(tmp_path, monkeypatch):
    """tf32 is a CUDA matmul mode: on a CPU the same fp32 arithmetic runs, so it gets the same peak."""
    monkeypatch.setenv("DIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(PEAK_ENV, raising=False)
    calls = _fake_probes(monkeypatch, [[2, 2], [2, 2]])
    fp32, tf32 = resolve_peak("cpu", "fp32"), resolve_peak("cpu", "tf32")
    assert tf32.flops == fp32.flops and tf32.precision == "fp32" and len(calls) == 2
    assert {c[0] for c in calls} == {"fp32"}  # the probe itself ran fp32


def test_a_busy_machine_does_not_replace_the_kept_cpu_peak(tmp_path, monkeypatch):
    """A probe taken while another job shares the cores is compared with a second probe and with the kept
    peak; a disagreeing or much lower measurement is not kept, and the detail says which peak was used."""
    import json

    from dit.cost import peaks

    monkeypatch.setenv("DIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(PEAK_ENV, raising=False)
    cache = tmp_path / "cpu_peaks.json"
    _fake_probes(monkeypatch, [[4, 1], [2, 1]])  # no peak kept yet; rounds 4 vs 2: busy
    busy = resolve_peak("cpu", "fp32")
    assert busy.flops == 4e12 and "not kept" in busy.detail and "disagreed" in busy.detail
    assert not cache.exists()
    _fake_probes(monkeypatch, [[4], [4.1]])  # agreeing rounds: kept
    assert resolve_peak("cpu", "fp32").flops == pytest.approx(4.1e12) and cache.exists()
    _age_cache(cache, peaks.CPU_PEAK_MAX_AGE_DAYS + 1)
    _fake_probes(monkeypatch, [[2], [2.05]])  # consistent but half the expired peak: the machine is busy
    low = resolve_peak("cpu", "fp32")
    assert low.flops == pytest.approx(4.1e12) and "below the expired peak" in low.detail
    _fake_probes(monkeypatch, [[3], [1]])  # disagreeing, below the expired one: the expired one is used
    assert resolve_peak("cpu", "fp32").flops == pytest.approx(4.1e12)
    assert next(iter(json.loads(cache.read_text()).values()))["tflops"] == pytest.approx(4.1)  # still the kept one
    _fake_probes(monkeypatch, [[5], [5.1]])  # agreeing and higher: replaces it
    assert resolve_peak("cpu", "fp32").flops == pytest.approx(5.1e12)
    assert next(iter(json.loads(cache.read_text()).values()))["tflops"] == pytest.approx(5.1)


def test_measured_matmul_peak_is_positive_and_fp8_is_refused():
    assert measure_matmul_peak("fp32", seconds=0.05, device="cpu") > 1e8
    bursts = measure_matmul_peak("fp32", seconds=0.05, device="cpu", probes=3)
    assert len(bursts) == 3 and min(bursts) > 1e8
    with pytest.raises(UserError, match="--peak-tflops"):
        measure_matmul_peak("fp8", seconds=0.05, device="cpu")


def test_fp32_stays_fp32_without_cuda():
    assert matmul_precision("fp32") in ("fp32", "tf32")  # tf32 only where CUDA allows it
    assert matmul_precision("bf16") == "bf16"


def test_device_memory_from_table_or_name():
    assert device_memory_bytes("NVIDIA A100-SXM4-40GB") == 40 * 2**30
    assert device_memory_bytes("NVIDIA A100 80GB PCIe") == 80 * 2**30
    assert device_memory_bytes("NVIDIA H200") == 141 * 2**30
    assert device_memory_bytes("NVIDIA GH200 480GB") is None  # 480 GB is CPU + GPU memory
    assert device_memory_bytes("A100") is None  # 40 or 80: not a guess
    assert device_memory_bytes("Imaginary X9000") is None


def test_the_peak_follows_the_runs_device(monkeypatch):
    """A --device cpu run on a GPU machine divides by the CPU's peak, not the GPU's datasheet."""
    import torch

    from dit.cost.peaks import peak_for_device

    monkeypatch.delenv(PEAK_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_for_device(torch.device("cuda", 0), "bf16").device == "H100 SXM"
    cpu = peak_for_device(torch.device("cpu"), "bf16")
    assert (cpu.device, cpu.source) == ("cpu", "measured")


@pytest.mark.parametrize("cache", ["a file", "a read-only folder"])
def test_an_unusable_peak_cache_is_one_warning_and_training_goes_on(
    cache, tmp_path, read_only, monkeypatch, capsys
):
    """The cache is an optimisation: DIT_CACHE_DIR naming a file stopped training with "File exists"."""
    from torch.utils.data import TensorDataset

    from dit.cost import peaks
    from dit.train import TrainConfig, train

    folder = tmp_path / "cache-file" if cache == "a file" else read_only
    if cache == "a file":
        folder.write_text("not a folder")
    monkeypatch.setenv("DIT_CACHE_DIR", str(folder))
    monkeypatch.delenv(PEAK_ENV, raising=False)
    monkeypatch.setattr(peaks, "_WARNED", set())
    _fake_probes(monkeypatch, [[2, 2], [2, 2], [2, 2], [2, 2]])
    peak = resolve_peak("cpu", "fp32")
    assert peak.flops == 2e12 and "not kept" in peak.detail
    data = TensorDataset(torch.rand(8, 3, 8, 8) * 2 - 1, torch.arange(8) % 4)
    cfg = TrainConfig.of(model="DiT-S/2", depth=1, hidden_size=32, num_heads=2, image_size=8, num_classes=4,
                         vae="none", global_batch_size=4, max_steps=2, precision="fp32", num_workers=0,
                         progress=False, results_dir=str(tmp_path / "run"))  # fmt: skip
    assert train(cfg, dataset=data)["status"] == "finished"
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(folder) in warnings[0] and "DIT_CACHE_DIR" in warnings[0], warnings
    assert (folder.read_text() == "not a folder") if cache == "a file" else not list(folder.iterdir())
