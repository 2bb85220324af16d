"""Dense peak FLOP/s per device and dtype: the MFU denominator, matched from the device name, never guessed.

Other trainers' tables fall back to the A100 for unknown devices (that is how MFU > 100% gets reported),
match "l40s" case-sensitively, or list one dtype. Here: one row per device with every dtype, a matcher on
whole words with the most specific name first, and for anything unknown (or the CPU) a measured matmul
peak labelled "measured". ``--peak-tflops`` and ``DIT_PEAK_TFLOPS`` override everything.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from dit.io.errors import UserError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
PEAK_ENV = "DIT_PEAK_TFLOPS"


@dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s
    source: str  # "table", "override", "env DIT_PEAK_TFLOPS" or "measured"
    device: str
    precision: str = ""  # the arithmetic the peak is of (a CPU's tf32 is fp32)
    detail: str = ""  # for a measured peak: how many probes, their spread, which was kept
    measured_on: str = ""  # a measured peak's date (ISO), so that every cost line can say its age

    def describe(self) -> str:
        """'0.434 TFLOP/s fp32 on cpu (measured 2026-12-01, 0 days old; best of 5 probes ...)': the peak, its
        source and its age, as every cost line prints it."""
        where = f" on {self.device}" if self.device else ""
        source = self.source
        if self.measured_on:
            age = (datetime.date.today() - datetime.date.fromisoformat(self.measured_on)).days
            source += f" {self.measured_on}, {age} day{'s' if age != 1 else ''} old"
        detail = f"; {self.detail}" if self.detail else ""
        return f"{self.flops / 1e12:.4g} TFLOP/s {self.precision}{where} ({source}{detail})"


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet dense TFLOP/s (sparsity halved); None where the device has no such rate."""

    name: str
    pattern: str  # regex on the normalised name (lower case, '-', '_' and '/' as spaces)
    fp32: float | None
    tf32: float | None
    bf16: float | None
    fp16: float | None
    fp8: float | None
    memory_gib: float | None  # None: several sizes exist
    memory_in_name: bool = False  # the name gives the size ("A100-SXM4-80GB"); GH200's "480GB" is CPU+GPU


# Order matters where one name is a prefix of another (GB200/B200, H200 NVL/H200, MI250X/MI250); patterns
# match whole words, so "gh200" is not "h200", "l40s" not "l40", "h20" not "h200". Sources: NVIDIA and
# AMD datasheets and whitepapers, Google Cloud TPU pages (see ../shared/research/accounting.md, 3.2).
# GeForce 16-bit rates are the FP32-accumulate ones PyTorch GEMMs use. MI250X/MI250 are per GCD (one torch
# device, half an OAM). TPUs are per chip and only for planning (torch.cuda never reports them).
DEVICES = (
    DeviceSpec("GB200", r"\bgb200\b", 80, 1250, 2500, 2500, 5000, 186),
    DeviceSpec("B200", r"\bb200\b", 75, 1100, 2250, 2250, 4500, 180),
    DeviceSpec("GH200", r"\bgh200\b", 67, 494.7, 989.4, 989.4, 1978.9, None),
    DeviceSpec("H200 NVL", r"\bh200\b.*\bnvl\b", 60, 420, 836, 836, 1671, 141),
    DeviceSpec("H200 SXM", r"\bh200\b", 67, 494.7, 989.4, 989.4, 1978.9, 141),
    DeviceSpec("H20", r"\bh20\b", 44, 74, 148, 148, 296, 96),
    DeviceSpec("H100 NVL", r"\bh100\b.*\bnvl\b", 60, 417.5, 835, 835, 1670, 94),
    DeviceSpec("H100 PCIe", r"\bh100\b.*\bpcie\b", 51, 378, 756, 756, 1513, 80),
    DeviceSpec("H100 SXM", r"\bh100\b", 67, 494.7, 989.4, 989.4, 1978.9, 80),
    DeviceSpec("H800 PCIe", r"\bh800\b.*\bpcie\b", 51, 378, 756, 756, 1513, 80),
    DeviceSpec("H800 SXM", r"\bh800\b(?!.*\bnvl\b)", 67, 494.7, 989.4, 989.4, 1978.9, 80),
    DeviceSpec("A100", r"\ba100\b", 19.5, 156, 312, 312, None, None, True),
    DeviceSpec("A800", r"\ba800\b", 19.5, 156, 312, 312, None, None, True),
    DeviceSpec("A10G", r"\ba10g\b", None, None, None, None, None, 24),  # NVIDIA publishes no A10G sheet
    DeviceSpec("A10", r"\ba10\b", 31.2, 62.5, 125, 125, None, 24),
    DeviceSpec("L40S", r"\bl40s\b", 91.6, 183, 362, 362, 733, 48),
    DeviceSpec("L40", r"\bl40\b", 90.5, 90.5, 181, 181, 362, 48),
    DeviceSpec("L4", r"\bl4\b", 30.3, 60, 121, 121, 242.5, 24),
    DeviceSpec("RTX 5090", r"\brtx 5090\s*$", 104.8, 104.8, 209.5, 209.5, 419, 32),
    DeviceSpec("RTX 4090", r"\brtx 4090\s*$", 82.6, 82.6, 165.2, 165.2, 330.3, 24),
    DeviceSpec("RTX 3090", r"\brtx 3090\s*$", 35.6, 35.6, 71, 71, None, 24),
    DeviceSpec("V100S PCIe", r"\bv100s\b", 16.4, None, None, 130, None, 32),
    DeviceSpec("V100 PCIe", r"\bv100 pcie\b", 14, None, None, 112, None, None, True),
    DeviceSpec("V100 SXM2", r"\bv100 sxm2\b", 15.7, None, None, 125, None, None, True),
    DeviceSpec("T4", r"\bt4\b", 8.1, None, None, 65, None, 16),
    DeviceSpec("MI325X", r"\bmi325x\b", 163.4, 653.7, 1307.4, 1307.4, 2614.9, 256),
    DeviceSpec("MI300X", r"\bmi300x\b", 163.4, 653.7, 1307.4, 1307.4, 2614.9, 192),
    DeviceSpec("MI250X", r"\bmi250x\b", 47.9, None, 191.5, 191.5, None, 64),
    DeviceSpec("MI250", r"\bmi250\b", 45.3, None, 181.0, 181.0, None, 64),
    DeviceSpec("TPU v3", r"\btpu ?v3\b", None, None, 123, None, None, 32),
    DeviceSpec("TPU v4", r"\btpu ?v4\b", None, None, 275, None, None, 32),
    DeviceSpec("TPU v5e", r"\btpu ?v5e\b", None, None, 197, None, None, 16),
    DeviceSpec("TPU v5p", r"\btpu ?v5p\b", None, None, 459, None, None, 95),
    DeviceSpec("TPU v6e", r"\btpu ?v6e\b", None, None, 918, None, None, 32),
)
KNOWN_DEVICES = tuple(d.name for d in DEVICES)
_HOW_TO_OVERRIDE = f"pass the peak with --peak-tflops (or set {PEAK_ENV}, in TFLOP/s)"
_HOW_TO_PLAN = "pass the peak with --peak-tflops (dense TFLOP/s per device)"  # plans ignore the env variable


def _normalise(name: str) -> str:
    return " ".join(re.sub(r"[-_/]", " ", name.lower()).split())


def find_device(device_name: str) -> DeviceSpec | None:
    """The table row for a ``torch.cuda.get_device_name()`` string or an alias like "H100-SXM"."""
    norm = _normalise(device_name)
    return next((d for d in DEVICES if re.search(d.pattern, norm)), None)


def device_memory_bytes(device_name: str) -> int | None:
    """Memory of one device (GiB as marketed), from the table or from names like "NVIDIA A100-SXM4-80GB"."""
    spec = find_device(device_name)
    if spec is None:
        return None
    if spec.memory_gib is not None:
        return int(spec.memory_gib * 2**30)
    size = re.search(r"\b(\d+)\s*gb\b", device_name.lower()) if spec.memory_in_name else None
    return int(size.group(1)) * 2**30 if size else None


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise UserError(f"unknown --precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")


def _table_tflops(spec: DeviceSpec, precision: str) -> float | None:
    if precision == "tf32" and spec.tf32 is None:
        return spec.fp32  # no TF32 units (pre-Ampere, CDNA2): fp32 matmuls run at the fp32 rate
    return getattr(spec, precision)


def table_peak(device_name: str, precision: str) -> Peak:
    """The datasheet peak, or a UserError that lists the known devices and how to pass a peak."""
    _check_precision(precision)
    spec = find_device(device_name)
    if spec is None:
        raise UserError(
            f"no peak FLOP/s known for device {device_name!r}; known devices: {', '.join(KNOWN_DEVICES)}. "
            f"For another device {_HOW_TO_PLAN}."
        )
    tflops = _table_tflops(spec, precision)
    if tflops is None:
        raise UserError(
            f"{spec.name} has no published dense {precision} rate"
            + (" (NVIDIA publishes no A10G datasheet)" if spec.name == "A10G" else "")
            + f"; {_HOW_TO_PLAN}, or choose a precision it supports."
        )
    return Peak(tflops * 1e12, "table", spec.name, precision)


def _override(override_tflops: float | None, device: str, precision: str) -> Peak | None:
    if override_tflops is not None:
        if not override_tflops > 0:
            raise UserError(f"--peak-tflops must be a positive number of TFLOP/s, got {override_tflops}.")
        return Peak(override_tflops * 1e12, "override", device, precision)
    env = os.environ.get(PEAK_ENV)
    if env:
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise UserError(f"{PEAK_ENV} must be a positive number of TFLOP/s, got {env!r}: fix or unset it.")
        return Peak(value * 1e12, f"env {PEAK_ENV}", device, precision)
    return None


def resolve_peak(
    device_name: str | None, precision: str, override_tflops: float | None = None, measure_seconds: float = 1.0
) -> Peak:
    """The peak to divide by: override, then env, then the table, then a measured matmul peak.

    ``device_name`` None or "cpu" measures the CPU; an unknown accelerator (or a known one without a
    published rate for ``precision``, like an A10G) is measured on the current device with a warning, and
    labelled "measured" so that nobody mistakes it for a datasheet figure. Training never stops for this:
    it names the device it runs on. A name that is not this machine's device is refused, not measured
    (``dit-cost peaks --gpu X`` on a machine without X measured the CPU and labelled it X).
    """
    _check_precision(precision)
    label = device_name or "cpu"
    forced = _override(override_tflops, label, precision)
    if forced is not None:
        return forced
    if device_name is None or device_name.lower() == "cpu":
        return cpu_peak(precision, measure_seconds)
    spec = find_device(device_name)
    if spec is not None and _table_tflops(spec, precision) is not None:
        return table_peak(device_name, precision)
    here = _this_device()
    present = (
        find_device(here) is spec
        if spec
        else re.search(rf"\b{re.escape(_normalise(device_name))}\b", _normalise(here))
    )
    if not present:
        unknown = f"no peak is known for {device_name!r} (known devices: {', '.join(KNOWN_DEVICES)})"
        raise UserError(
            f"{f'{spec.name} has no published dense {precision} rate' if spec else unknown}, and a measured peak "
            f"needs that device, which this machine lacks (it has {here}): measure it on a machine with one, or "
            f"{_HOW_TO_PLAN}."
        )
    warnings.warn(
        f"no datasheet {precision} peak for {device_name!r}; MFU is against a measured matmul peak. To use "
        f"the datasheet figure, {_HOW_TO_OVERRIDE}.",
        stacklevel=2,
    )
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    flops = measure_matmul_peak(precision, measure_seconds, device)
    return Peak(flops, "measured", f"{device_name} (measured)", precision)


def matmul_precision(precision: str) -> str:
    """What fp32 matmuls really run in on this machine: TF32 when CUDA allows it (the official DiT recipe)."""
    import torch

    if precision == "fp32" and torch.cuda.is_available() and _cuda_matmul_mode() == "tf32":
        return "tf32"
    return precision


def _cuda_matmul_mode() -> str:
    """CUDA's fp32 matmul mode through the per-backend API (mixing it with the legacy one is an error)."""
    import torch

    mode = torch.backends.cuda.matmul.fp32_precision
    return torch.backends.fp32_precision if mode == "none" else mode


def device_name(device=None) -> str:
    """``torch.cuda.get_device_name`` of ``device`` (default: the current CUDA device, else "cpu"), with the
    MI250X/MI250 ambiguity resolved by compute-unit count."""
    import torch

    device = torch.device(device) if device is not None else None
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(device)
    if "MI250X/MI250" in name and torch.cuda.get_device_properties(device).multi_processor_count == 104:
        return "AMD Instinct MI250"  # an MI250 GCD has 104 CUs, an MI250X GCD 110
    return name


def _this_device() -> str:
    """The name of the device a measurement here would run on (resolve_peak's argument hides device_name)."""
    return device_name()


def peak_for_device(device, precision: str, override_tflops: float | None = None) -> Peak:
    """The peak of the torch device a run uses: a ``--device cpu`` run on a GPU machine divides by the CPU."""
    name = device_name(device)
    return resolve_peak(name, precision if name == "cpu" else matmul_precision(precision), override_tflops)


_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch loads lazily


def measure_matmul_peak(
    precision: str = "fp32", seconds: float = 1.0, device: str | None = None, probes: int = 1
) -> float | list[float]:
    """Best FLOP/s of a square matmul in each of ``probes`` bursts of ``seconds / probes``.

    One burst returns a float (the ceiling for unknown devices); several return the list, so that a
    caller can show the spread: on a shared or throttling machine single bursts differ by 2x."""
    import torch

    if precision not in _DTYPES:
        raise UserError(f"cannot measure a {precision} matmul peak here; {_HOW_TO_OVERRIDE}.")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    n = 8192 if on_gpu else 1024
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if on_gpu and precision in ("fp32", "tf32") and (_cuda_matmul_mode() == "tf32") != (precision == "tf32"):
        raise ValueError(  # dit.runtime is the one place that sets the mode; a caller measures inside it
            f"a {precision} peak measured in CUDA's {_cuda_matmul_mode()} matmul mode: measure inside "
            f"dit.runtime.Precision({precision!r}, 'cuda').flags()"
        )
    a = torch.randn(n, n, device=device, dtype=getattr(torch, _DTYPES[precision]))
    b = torch.randn(n, n, device=device, dtype=getattr(torch, _DTYPES[precision]))
    a @ b  # warm-up: kernel selection, thread pools
    sync()
    bests = []
    for _ in range(probes):
        best, deadline = 0.0, time.perf_counter() + seconds / probes
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            a @ b
            sync()
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
        bests.append(best)
    return bests[0] if probes == 1 else bests


# --------------------------------------------------------------------------------------------------------
# The CPU: no datasheet, so a measured peak, kept per machine so that every run divides by the same number
# --------------------------------------------------------------------------------------------------------

CACHE_ENV = "DIT_CACHE_DIR"
CPU_PEAK_PROBES = 5
CPU_PEAK_MAX_AGE_DAYS = 30


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dit-ledger")


def cpu_arithmetic(precision: str) -> str:
    """What a CPU really computes for ``precision``: tf32 is a CUDA matmul mode, so on a CPU it is fp32 (its
    own probe once measured 0.057 TFLOP/s against fp32's 0.434 on one machine: one arithmetic, two peaks)."""
    return "fp32" if precision == "tf32" else precision


def _cpu_key(arithmetic: str) -> str:
    """What a CPU peak depends on: the processor model, the threads torch uses, torch's version, the dtype."""
    import torch

    model = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | {torch.get_num_threads()} threads | torch {torch.__version__} | {arithmetic}"


# Two probes (or a probe and the kept peak) further apart than this mean another job shares the cores.
CPU_PEAK_AGREEMENT = 0.10


def cpu_peak(precision: str, seconds: float = 1.0) -> Peak:
    """The CPU's matmul peak: the best of ``CPU_PEAK_PROBES`` bursts, kept per machine for 30 days.

    One 1 s probe at start-up measured 0.097, 0.049 and 0.060 TFLOP/s in three runs minutes apart, so MFU
    moved with the probe more than with the run. The best of several bursts is a ceiling noise can only
    lower, and the cache (``$DIT_CACHE_DIR`` or ~/.cache/dit-ledger/cpu_peaks.json) makes every later run
    on the machine divide by the same number. A new measurement is two rounds of probes; it is kept only
    if the rounds agree within ``CPU_PEAK_AGREEMENT`` and it is not that far below an expired kept peak
    (a busy machine measures low): otherwise this run uses the better figure and keeps nothing, and the
    detail says which was used and why. Delete the file to measure again.
    """
    arithmetic = cpu_arithmetic(precision)
    path = cache_dir() / "cpu_peaks.json"
    key = _cpu_key(arithmetic)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    cache = cache if isinstance(cache, dict) else {}
    entry = _valid_entry(cache.get(key))
    today = datetime.date.today()
    if entry is not None and (today - datetime.date.fromisoformat(entry["date"])).days <= CPU_PEAK_MAX_AGE_DAYS:
        return _cpu_peak_of(entry, arithmetic, f"kept in {path}")
    rounds = [
        [p / 1e12 for p in measure_matmul_peak(arithmetic, seconds / 2, "cpu", probes=CPU_PEAK_PROBES)]
        for _ in range(2)
    ]
    first, second = (max(r) for r in rounds)
    new = {"tflops": max(first, second), "probes": rounds[0] + rounds[1], "date": today.isoformat()}
    if min(first, second) < (1 - CPU_PEAK_AGREEMENT) * max(first, second):
        if entry is not None and entry["tflops"] >= new["tflops"]:
            why = (
                f"this run's two probe rounds disagreed ({first:.4g} vs {second:.4g} TFLOP/s: the machine is busy)"
            )
            return _cpu_peak_of(entry, arithmetic, f"{why}, so the expired one kept in {path} is used")
        return _cpu_peak_of(
            new, arithmetic,
            f"not kept: its two probe rounds disagreed ({first:.4g} vs {second:.4g} TFLOP/s), so the machine is "
            "busy; the next run measures again",
        )  # fmt: skip
    if entry is not None and new["tflops"] < (1 - CPU_PEAK_AGREEMENT) * entry["tflops"]:
        return _cpu_peak_of(
            entry, arithmetic,
            f"this run measured {new['tflops']:.4g} TFLOP/s, more than {CPU_PEAK_AGREEMENT:.0%} below the expired "
            f"peak kept in {path}, so the machine is busy and that one is used",
        )  # fmt: skip
    unusable = _keep(path, json.dumps({**cache, key: new}, indent=1).encode())
    return _cpu_peak_of(new, arithmetic, f"not kept ({path}: {unusable})" if unusable else f"kept in {path}")


_WARNED: set[Path] = set()


def _keep(path: Path, data: bytes) -> str | None:
    """Write the cache file; None, or why it cannot be. The cache is an optimisation: a ``$DIT_CACHE_DIR``
    that is a file, read-only or not creatable (it stopped training with "File exists") is one warning line
    per process, on rank 0, and the run goes on with its peak measured and not kept."""
    from dit.io.atomic import atomic_write_bytes

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        unusable = None if os.access(path.parent, os.W_OK | os.X_OK) else "not writable"
    except OSError as e:
        unusable = e.strerror or str(e)
    if unusable is None:
        try:
            atomic_write_bytes(path, data)
            return None
        except UserError as e:  # a full disk: its message says which
            unusable = str(e)
    if path.parent not in _WARNED and os.environ.get("RANK", "0") == "0":
        _WARNED.add(path.parent)
        print(
            f"warning: the peak cache {path.parent} cannot be used ({unusable}): the CPU peak is measured without "
            f"it; point {CACHE_ENV} at a writable folder to keep it.",
            file=sys.stderr,
        )
    return unusable


def forget_cpu_peak(precision: str) -> Path | None:
    """Drop this machine's kept peak for ``precision`` (a run computed faster than it: it was measured while
    another job had the cores); the next run measures again. Returns the cache file it was dropped from."""
    path = cache_dir() / "cpu_peaks.json"
    try:
        cache = json.loads(path.read_text())
        cache.pop(_cpu_key(cpu_arithmetic(precision)))
        from dit.io.atomic import atomic_write_bytes

        atomic_write_bytes(path, json.dumps(cache, indent=1).encode())
        return path
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def _valid_entry(entry) -> dict | None:
    try:
        datetime.date.fromisoformat(entry["date"])
        if float(entry["tflops"]) > 0 and all(float(p) > 0 for p in entry["probes"]):
            return entry
    except (KeyError, TypeError, ValueError):
        pass
    return None


def _cpu_peak_of(entry: dict, arithmetic: str, kept: str) -> Peak:
    probes = entry["probes"]
    detail = f"best of {len(probes)} probes, spread {min(probes):.4g}-{max(probes):.4g} TFLOP/s, {kept}"
    return Peak(entry["tflops"] * 1e12, "measured", "cpu", arithmetic, detail, entry["date"])
