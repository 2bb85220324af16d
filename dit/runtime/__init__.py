"""The process a face runs in: ``runtime``, ``precision``, ``stop``, ``host_memory``."""

from dit.runtime.host_memory import keep_freed_host_memory
from dit.runtime.precision import PRECISIONS, Precision
from dit.runtime.runtime import DeviceSection, Runtime, Stream, default_workers, mix_seed
from dit.runtime.stop import StopFlag

__all__ = [
    "PRECISIONS", "DeviceSection", "Precision", "Runtime", "StopFlag", "Stream", "default_workers",
    "keep_freed_host_memory", "mix_seed",
]  # fmt: skip
