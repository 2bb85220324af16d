"""The process a face runs in: device, process group, precision policy, stop flag and the one seed mixer. Nothing
else joins a process group, sets TF32/cuDNN flags or tunes host memory."""

from __future__ import annotations

import enum
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dit.io.atomic import FolderLock
from dit.io.config import Section, option
from dit.io.errors import ReportedByRankZero, UserError
from dit.io.launcher import check_process_count, process_env, rendezvous_seconds
from dit.runtime import host_memory
from dit.runtime.precision import PRECISIONS, Precision
from dit.runtime.stop import ignore_stop_signals

_MASK = (1 << 63) - 1


class Stream(enum.IntEnum):
    """The first word of every keyed random stream, so that no two kinds of stream ever share a seed."""

    EPOCH = 0  # an epoch's permutation of the data
    STEP = 1  # a training step's timesteps, noise and class dropout
    GRID = 2  # the noise of the in-training sample grids
    ITEM = 3  # an item's augmentation (flip, posterior sample)
    NOISE = 4  # a sampled image's noise
    LABEL = 5  # an FID sample set image's class
    EVAL = 6  # the labels and noise of the in-training evaluations
    TOKENS = 7  # a training step's kept tokens (token dropping)
    LABEL_ORDER = 8  # a balanced sample set's extra classes and the order of its labels


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64's finaliser): every keyed stream's ``mix_seed(Stream.X, ...)``."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        if int(p) < 0:
            raise UserError(f"seeds must be >= 0, got {p}.")
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h & _MASK


@dataclass(frozen=True)
class DeviceSection(Section):
    """Where and in what precision a face runs, and the peak its MFU divides by; each face sets its precision."""

    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda when available)")
    precision: str = option("bf16", "matmul precision: fp32, tf32 (fp32 with TF32 matmuls), bf16 or fp16 (CUDA)",
                            choices=PRECISIONS)  # fmt: skip
    peak_tflops: float | None = option(None, "the device's peak TFLOP/s for MFU (default: datasheet, else measured)",
                                       gt=0)  # fmt: skip


def default_workers() -> int:
    """Data-loader processes by default: one per usable core, at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def _device(requested: str | None, local_rank: int, world: int) -> torch.device:
    if requested is not None and requested.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(
            f"--device {requested} was asked for but no CUDA device is visible: drop --device or use cpu."
        )
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if requested not in (None, "cuda") and world == 1:
        return torch.device(requested)  # "cuda:1" on one process
    return torch.device("cuda", local_rank)


def _rendezvous(env) -> dist.TCPStore:
    """The group's store, waiting ``rendezvous_seconds()`` for every rank (torch waits 30 minutes, silently)."""
    seconds = rendezvous_seconds()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        return dist.TCPStore(host, port, env.world, is_master=env.rank == 0, timeout=timedelta(seconds=seconds),
                             wait_for_workers=True)  # fmt: skip
    except (RuntimeError, OSError) as e:  # DistStoreError and DistNetworkError are RuntimeErrors
        raise UserError(
            f"rank {env.rank} of WORLD_SIZE={env.world} did not meet the others at {host}:{port} within "
            f"{seconds:g} s ({str(e).strip().splitlines()[0][:120]}): start every rank (torchrun does), or unset "
            "WORLD_SIZE for one process; DIT_RENDEZVOUS_TIMEOUT_S sets the wait."
        ) from None


class Runtime:
    """``with Runtime(device, precision) as rt``: one face's rank, world, device and precision, restored after."""

    @classmethod
    def of(cls, section: DeviceSection, **kw) -> Runtime:
        return cls(section.device, section.precision, **kw)

    def __init__(
        self,
        device: str | None = None,
        precision: str = "fp32",
        deterministic: bool = False,
        timeout: timedelta | None = None,
    ):
        script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "train.py"
        self.env = process_env(script)
        self.world, self.rank, self.local_rank = self.env.world, self.env.rank, self.env.local_rank
        check_process_count(self.world, script)
        self.device = _device(device, self.local_rank, self.world)
        self.precision = Precision(precision, self.device.type)
        self._deterministic, self._timeout = deterministic, timeout
        self._owns_group, self._flags = False, None

    def __enter__(self) -> Runtime:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            host_memory.keep_freed_host_memory()
        if self.world > 1 and not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            kw = {"timeout": self._timeout} if self._timeout else {}
            if not self.env.under_torchrun:  # started by hand or by srun: bound the wait for the others
                kw["store"] = _rendezvous(self.env)
                kw.update(rank=self.rank, world_size=self.world)
            dist.init_process_group(backend, **kw)
            self._owns_group = True
        if dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._flags = self.precision.flags(self._deterministic)
        self._flags.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._flags.__exit__(*exc)
        if self._owns_group:
            dist.destroy_process_group()
            self._owns_group = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def sync(self) -> None:
        """Wait for the device, before reading a clock."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over all ranks (a no-op on one); ``op`` is sum or max."""
        if self.world > 1:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return tensor

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def raise_together(self, error: UserError | None) -> None:
        """Every rank learns whether rank 0 met ``error`` (collective): rank 0 raises it, the others
        ``ReportedByRankZero``, then ignore the stop signals so that torchrun's signal cuts no rank's line."""
        said = next((e for e in self.gather_objects(error) if e is not None), None)
        if said is None:
            return
        if self.world > 1:
            ignore_stop_signals()
        raise said if self.is_main else ReportedByRankZero(str(said))

    def memory_capacity(self) -> int:
        """The bytes a step may fill: the GPU's, or the host's shared by its processes; the ranks' minimum."""
        if self.device.type == "cuda":
            mine = torch.cuda.get_device_properties(self.device).total_memory
        else:
            hosts = self.gather_objects(socket.gethostname())
            mine = host_memory.host_memory_bytes() // hosts.count(hosts[self.rank])
        return min(self.gather_objects(mine))

    def lock_folder(self, folder, purpose: str, fix: str) -> FolderLock | None:
        """Rank 0 locks ``folder`` (None elsewhere); if another job holds it, every rank raises the same line."""
        lock, error = None, None
        if self.is_main:
            try:
                lock = FolderLock(folder, purpose, fix).acquire()
            except UserError as e:
                error = str(e)
        if error := self.gather_objects(error)[0]:
            raise UserError(error)
        return lock

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on all), in rank order; on the group's device (NCCL: this GPU)."""
        if self.world == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor.contiguous())
        return parts
