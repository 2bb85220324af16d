"""Dense peak FLOP/s per device and dtype: the MFU denominator, matched from the device name, never guessed:
``dit.cost.devices``' datasheet rows, else (and on the CPU) a matmul peak labelled "measured";
``--peak-tflops`` and ``DIT_PEAK_TFLOPS`` override everything."""

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

from dit.cost.devices import DEVICES as DEVICES  # re-exported: dit-cost peaks prints the table
from dit.cost.devices import KNOWN_DEVICES, PRECISIONS, DeviceSpec, find_device, normalised_name
from dit.cost.devices import device_memory_bytes as device_memory_bytes  # re-exported for the planner
from dit.io.errors import UserError

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
        """'X TFLOP/s fp32 on cpu (measured DATE, N days old; ...)', as every cost line prints it."""
        where = f" on {self.device}" if self.device else ""
        source = self.source
        if self.measured_on:
            age = (datetime.date.today() - datetime.date.fromisoformat(self.measured_on)).days
            source += f" {self.measured_on}, {age} day{'s' if age != 1 else ''} old"
        detail = f"; {self.detail}" if self.detail else ""
        return f"{self.flops / 1e12:.4g} TFLOP/s {self.precision}{where} ({source}{detail})"


_HOW_TO_OVERRIDE = f"pass the peak with --peak-tflops (or set {PEAK_ENV}, in TFLOP/s)"
_HOW_TO_PLAN = "pass the peak with --peak-tflops (dense TFLOP/s per device)"  # plans ignore the env variable


def _table_tflops(spec: DeviceSpec, precision: str) -> float | None:
    """The row's rate for ``precision``; None where it has none (a dtype that is no column has none)."""
    if precision == "tf32" and spec.tf32 is None:
        return spec.fp32  # no TF32 units (pre-Ampere, CDNA2): fp32 matmuls run at the fp32 rate
    return getattr(spec, precision) if precision in PRECISIONS else None


def table_peak(device_name: str, precision: str) -> Peak:
    """The datasheet peak, or a UserError that lists the known devices and how to pass a peak."""
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


def resolve_peak(
    name: str | None, precision: str, override_tflops: float | None = None, measure_seconds: float = 1.0
) -> Peak:
    """The peak to divide by: override, then env, then the table, then a matmul peak measured (with a warning)
    on this machine's device; a device this machine lacks is refused, not measured. None or "cpu": the CPU."""
    if override_tflops is not None:  # --peak-tflops, checked at its field
        return Peak(override_tflops * 1e12, "override", name or "cpu", precision)
    if env := os.environ.get(PEAK_ENV):
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise UserError(f"{PEAK_ENV} must be a positive number of TFLOP/s, got {env!r}: fix or unset it.")
        return Peak(value * 1e12, f"env {PEAK_ENV}", name or "cpu", precision)
    if name is None or name.lower() == "cpu":
        return cpu_peak(precision, measure_seconds)
    spec = find_device(name)
    if spec is not None and _table_tflops(spec, precision) is not None:
        return table_peak(name, precision)
    here = device_name()
    pattern = rf"\b{re.escape(normalised_name(name))}\b"
    present = find_device(here) is spec if spec else re.search(pattern, normalised_name(here))
    if not present:
        unknown = f"no peak is known for {name!r} (known devices: {', '.join(KNOWN_DEVICES)})"
        raise UserError(
            f"{f'{spec.name} has no published dense {precision} rate' if spec else unknown}, and a measured peak "
            f"needs that device, which this machine lacks (it has {here}): measure it on a machine with one, or "
            f"{_HOW_TO_PLAN}."
        )
    warnings.warn(
        f"no datasheet {precision} peak for {name!r}; MFU is against a measured matmul peak. To use "
        f"the datasheet figure, {_HOW_TO_OVERRIDE}.",
        stacklevel=2,
    )
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    flops = measure_matmul_peak(precision, measure_seconds, device)
    return Peak(flops, "measured", f"{name} (measured)", precision)


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
    """``torch.cuda.get_device_name`` of ``device`` (default: the current CUDA device, else "cpu")."""
    import torch

    device = torch.device(device) if device is not None else None
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(device)
    if "MI250X/MI250" in name and torch.cuda.get_device_properties(device).multi_processor_count == 104:
        return "AMD Instinct MI250"  # an MI250 GCD has 104 CUs, an MI250X GCD 110
    return name


def peak_for_device(device, precision: str, override_tflops: float | None = None) -> Peak:
    """The peak of the torch device a run uses: a ``--device cpu`` run on a GPU machine divides by the CPU."""
    name = device_name(device)
    return resolve_peak(name, precision if name == "cpu" else matmul_precision(precision), override_tflops)


_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch loads lazily


def measure_matmul_peak(
    precision: str = "fp32", seconds: float = 1.0, device: str | None = None, probes: int = 1
) -> float | list[float]:
    """Best FLOP/s of a square matmul in each of ``probes`` bursts of ``seconds / probes`` (one burst: a float)."""
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
    a, b = (torch.randn(n, n, device=device, dtype=getattr(torch, _DTYPES[precision])) for _ in range(2))
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


# The CPU: no datasheet, so a measured peak, kept per machine so that every run divides by the same number.

CACHE_ENV = "DIT_CACHE_DIR"
CPU_PEAK_PROBES = 5
CPU_PEAK_MAX_AGE_DAYS = 30


def _kept_peaks() -> tuple[Path, dict]:
    """The file of this machine's kept CPU peaks, and what it holds ({} when it is absent or unreadable)."""
    path = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dit-ledger") / "cpu_peaks.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    return path, cache if isinstance(cache, dict) else {}


def cpu_arithmetic(precision: str) -> str:
    """What a CPU computes for ``precision``: tf32 is a CUDA matmul mode, so on a CPU it is fp32."""
    return "fp32" if precision == "tf32" else precision


def _cpu_key(arithmetic: str) -> str:
    """What a CPU peak depends on: the processor model, the threads torch uses, torch's version, the dtype."""
    import torch

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown cpu")
    return f"{model} | {torch.get_num_threads()} threads | torch {torch.__version__} | {arithmetic}"


# Two probes (or a probe and the kept peak) further apart than this mean another job shares the cores.
CPU_PEAK_AGREEMENT = 0.10


def cpu_peak(precision: str, seconds: float = 1.0) -> Peak:
    """The CPU's matmul peak: the best of ``CPU_PEAK_PROBES`` bursts (a ceiling noise can only lower), kept per
    machine for 30 days (docs/cost_model.md, section 5). Two rounds of probes: kept only if they agree within
    ``CPU_PEAK_AGREEMENT`` and are not that far below an expired kept peak; else the better figure, unkept."""
    arithmetic = cpu_arithmetic(precision)
    path, cache = _kept_peaks()
    key = _cpu_key(arithmetic)
    entry = cache.get(key)
    try:  # a valid entry, else None
        datetime.date.fromisoformat(entry["date"])
        entry = entry if float(entry["tflops"]) > 0 and all(float(p) > 0 for p in entry["probes"]) else None
    except (KeyError, TypeError, ValueError):
        entry = None
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
    """Write the cache file; None, or why it cannot be (then one warning per process, on rank 0)."""
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
    """Drop this machine's kept peak for ``precision`` (a run beat it: it was measured on a busy machine)."""
    from dit.io.atomic import atomic_write_bytes

    path, cache = _kept_peaks()
    if cache.pop(_cpu_key(cpu_arithmetic(precision)), None) is None:
        return None
    try:
        atomic_write_bytes(path, json.dumps(cache, indent=1).encode())
        return path
    except OSError:
        return None


def _cpu_peak_of(entry: dict, arithmetic: str, kept: str) -> Peak:
    probes = entry["probes"]
    detail = f"best of {len(probes)} probes, spread {min(probes):.4g}-{max(probes):.4g} TFLOP/s, {kept}"
    return Peak(entry["tflops"] * 1e12, "measured", "cpu", arithmetic, detail, entry["date"])
