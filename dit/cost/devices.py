"""The datasheet table: dense peak TFLOP/s per device and dtype, and the matcher from a device's name to its row.
Data, not logic; docs/cost_model.md (section 5) gives the sources and the matching rules."""

from __future__ import annotations

import re
from dataclasses import dataclass

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")  # the table's dtype columns


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


# Order matters where one name is a prefix of another (GB200/B200, H200 NVL/H200, MI250X/MI250); patterns match
# whole words ("gh200" is not "h200"). GeForce 16-bit: FP32-accumulate; MI250X/MI250: per GCD; TPUs: per chip.
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


def normalised_name(name: str) -> str:
    """Lower case, with '-', '_' and '/' as spaces: what the rows' patterns match."""
    return " ".join(re.sub(r"[-_/]", " ", name.lower()).split())


def find_device(device_name: str) -> DeviceSpec | None:
    """The table row for a ``torch.cuda.get_device_name()`` string or an alias like "H100-SXM"."""
    norm = normalised_name(device_name)
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
