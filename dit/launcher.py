"""What a launcher asked for that its environment does not carry in torchrun's terms.

dit-ledger joins process groups from the variables torchrun sets (``dit.runtime``). ``accelerate launch``
sets them too when it hands over to torchrun (``--multi_gpu``), but on CPUs (``--cpu --num_processes 2``)
it starts one process without a word unless mpirun is set up, and its ``--mixed_precision`` travels as
``ACCELERATE_MIXED_PRECISION``. Both are read here, so that a run does what was asked or says why not.
No torch: the flag parser reads the precision.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from dit.errors import UserError

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
    """The process count a launcher was asked for, where WORLD_SIZE may not say it: mpirun's world size, or
    ``accelerate launch``'s ``--num_processes`` read from the launching command line (Linux)."""
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
    """Refuse, in one line, a launch that started another number of processes than it was asked for. Where
    torchrun's WORLD_SIZE is set it is the answer (an srun around torchrun has its own, smaller, MPI size)."""
    if "WORLD_SIZE" in os.environ:
        return
    asked = requested_processes()
    if asked is not None and asked != world:
        raise UserError(
            f"the launcher asked for {asked} processes but this job has {world} (accelerate launch runs several "
            "CPU processes only through mpirun, and dit-ledger joins process groups from torchrun's environment): "
            f"launch with `{shlex.join(['torchrun', f'--nproc_per_node={asked}', script])} ...` instead."
        )
