"""What a launcher asked for that its environment does not carry in torchrun's terms: ``accelerate launch``'s
process count on CPUs and its ``--mixed_precision``, read so that a run does what was asked or says why not."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from dit.io.errors import UserError

# accelerate's --mixed_precision -> our --precision ("no" is its name for full precision).
ACCELERATE_PRECISIONS = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
_MPI_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")


def launcher_precision() -> str | None:
    """The precision ``accelerate launch --mixed_precision X`` asked for (None: not under accelerate)."""
    raw = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if raw is None:
        return None
    if raw.lower() not in ACCELERATE_PRECISIONS:
        raise UserError(
            f"accelerate launch --mixed_precision {raw} has no dit-ledger counterpart: launch with "
            "--mixed_precision bf16, fp16 or no, or with torchrun and --precision."
        )
    return ACCELERATE_PRECISIONS[raw.lower()]


def requested_processes() -> int | None:
    """The process count asked of a launcher: mpirun's world size, or ``accelerate launch``'s."""
    for name in _MPI_SIZE:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    if "ACCELERATE_MIXED_PRECISION" not in os.environ:
        return None
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    for i, arg in enumerate(args):
        for flag in ("--num_processes", "--num-processes"):
            value = arg.removeprefix(flag + "=") if arg.startswith(flag + "=") else None
            if arg == flag and i + 1 < len(args):
                value = args[i + 1]
            if value is not None and value.isdigit():
                return int(value)
    return None


def check_process_count(world: int, script: str = "train.py") -> None:
    """Refuse a launch that started another number of processes than asked (torchrun's WORLD_SIZE wins)."""
    if "WORLD_SIZE" in os.environ:
        return
    asked = requested_processes()
    if asked is not None and asked != world:
        raise UserError(
            f"the launcher asked for {asked} processes but this job has {world} (accelerate launch runs several "
            "CPU processes only through mpirun, and dit-ledger joins process groups from torchrun's environment): "
            f"launch with `{shlex.join(['torchrun', f'--nproc_per_node={asked}', script])} ...` instead."
        )


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the job, from torchrun's variables, checked before anything waits on them."""

    world: int
    rank: int
    local_rank: int
    under_torchrun: bool  # torchrun's agents met before starting us: the group forms at once


def process_env(script: str = "train.py") -> ProcessEnv:
    """WORLD_SIZE, RANK, LOCAL_RANK (and MASTER_ADDR/PORT) as torchrun sets them; a bad environment is one line."""
    launch = f"launch with `torchrun --nproc_per_node=N {script} ...`, or unset it for one process"

    def number(name: str, default: int, low: int) -> int:
        raw = os.environ.get(name)
        if raw is None:
            return default
        if not raw.strip().isdigit() or int(raw) < low:
            raise UserError(f"{name}={raw!r} in the environment is not a whole number >= {low}: {launch}.")
        return int(raw)

    world = number("WORLD_SIZE", 1, 1)
    local_rank = number("LOCAL_RANK", 0, 0)
    if world == 1:
        return ProcessEnv(1, 0, local_rank, False)
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise UserError(
            f"WORLD_SIZE={world} is set but {', '.join(missing)} not (torchrun sets all four): {launch}."
        )
    rank = number("RANK", 0, 0)
    if rank >= world:
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world} (ranks are 0..{world - 1}): {launch}.")
    number("MASTER_PORT", 0, 1)
    return ProcessEnv(world, rank, local_rank, "TORCHELASTIC_RUN_ID" in os.environ)


def rendezvous_seconds() -> float:
    """How long a process group started by hand waits for its other ranks (``DIT_RENDEZVOUS_TIMEOUT_S``)."""
    raw = os.environ.get("DIT_RENDEZVOUS_TIMEOUT_S", "300")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise UserError(f"DIT_RENDEZVOUS_TIMEOUT_S={raw!r} is not a positive number of seconds.")
    return seconds
