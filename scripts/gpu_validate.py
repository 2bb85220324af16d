"""The sections of scripts/gpu_validate.sh, one subcommand each, so that each runs (and is tested) alone: the
device's kernels and flags in ``gpu_checks``, the trainer's path in ``gpu_train_checks``; here the shared
``Ctx``, the records and what comes back.

  python scripts/gpu_validate.py SECTION --work SCRATCH [--dry-run] [--budget SECONDS] [--fail]
  python scripts/gpu_validate.py finish SECTION --work SCRATCH --out DIR --rc RC --seconds S   # after each

A section works in SCRATCH/work/NAME and writes its record, {name, status (ok, failed, skipped), seconds,
figures}, to SCRATCH/sections/NAME.json when it ends; ``finish`` writes one for a section whose process died or
timed out without writing it (status failed or timeout, the log's tail kept), then writes the two files that
come back in DIR: ``gpu_validate.json`` (every record) and ``logs.tar.gz`` (each section's log, its tail where
long). A check that does not hold is listed in the figures' ``problems`` and fails its section; a part that
cannot run on this machine (a CUDA-only check in the CPU dry run) is listed in ``skipped_parts`` with the
reason. ``--dry-run`` runs every section on the CPU with tiny shapes; ``--fail`` makes the section fail at once
(to test that the others still run).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from dit.io.cli import run_cli
from dit.io.config import Face, FieldError, Section, option

SECTIONS = ("env", "flags", "numerics", "sync", "parallel", "bench", "e2e", "sample")
RETURNED = ("gpu_validate.json", "logs.tar.gz")  # all that is written to DIR
LOG_TAIL_BYTES = 1 << 20  # of each log, in the archive: eight sections stay far under the 16 MiB a file may be
STATUSES = ("ok", "failed", "timeout", "skipped")
TIMEOUT_CODES = (124, 137)  # timeout(1): the limit passed, or the process had to be killed


# ---- records ------------------------------------------------------------------------------------------------


def _write(path: Path, record) -> None:
    from dit.io.atomic import atomic_write_bytes

    atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())


def _compiles() -> dict | None:
    """The graphs Dynamo compiled in this process and its seconds on them (forward compiles: a lazily compiled
    backward is not counted), or None where nothing was compiled."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import compilation_time_metrics, counters

    graphs = counters["stats"]["unique_graphs"]
    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))
    return {"graphs": graphs, "dynamo_seconds": seconds} if graphs else None


def _section(name: str):
    """The function of a section, from the module that holds it (imported here: they import this one)."""
    import gpu_checks
    import gpu_train_checks

    return getattr(gpu_checks, f"section_{name}", None) or getattr(gpu_train_checks, f"section_{name}")


def run_section(name: str, work: Path, dry_run: bool, budget: float, fail: bool) -> int:
    from gpu_context import Ctx, _tail  # beside this script: importable where it runs, not where it is read

    start = time.perf_counter()
    record = {"name": name, "status": "ok", "seconds": None, "figures": {}}
    try:
        ctx = Ctx(work / "work" / name, dry_run, budget)
        if fail:
            raise RuntimeError("made to fail (--fail)")
        record["figures"] = _section(name)(ctx)
        if ctx.skipped:
            record["figures"]["skipped_parts"] = ctx.skipped
        if ctx.problems:
            record.update(status="failed", problems=ctx.problems)
    except Exception as e:
        record.update(
            status="failed", error=f"{type(e).__name__}: {e}", traceback=_tail(traceback.format_exc(), 20)
        )
    record["seconds"] = time.perf_counter() - start
    record["compiles"] = _compiles()
    _write(work / "sections" / f"{name}.json", record)
    return 0 if record["status"] == "ok" else 1


def finish(name: str, work: Path, out: Path, rc: int, seconds: float, dry_run: bool) -> int:
    """A record for a section whose process wrote none (killed, timed out, crashed), then the two files that come
    back: every record so far in ``DIR/gpu_validate.json`` and the logs in ``DIR/logs.tar.gz``."""
    from gpu_context import _tail

    path = work / "sections" / f"{name}.json"
    log = work / "logs" / f"{name}.log"
    if not path.exists():
        record = {
            "name": name,
            "status": "timeout" if rc in TIMEOUT_CODES else "failed",
            "seconds": seconds,
            "figures": {},
            "error": f"the section's process ended with status {rc} and wrote no record",
            "log_tail": _tail(log.read_text(errors="replace")) if log.exists() else "",
        }
        _write(path, record)
    else:
        record = json.loads(path.read_text())
        record["process_seconds"] = seconds  # with the interpreter's start and end
        _write(path, record)
    records = {p.stem: json.loads(p.read_text()) for p in (work / "sections").glob("*.json")}
    out.mkdir(parents=True, exist_ok=True)
    _write(
        out / RETURNED[0],
        {"dry_run": dry_run, "complete": set(SECTIONS) <= set(records),
         "sections": [records[s] for s in SECTIONS if s in records]},
    )  # fmt: skip
    _pack_logs(work / "logs", out / RETURNED[1])
    return 0


def _pack_logs(logs: Path, archive: Path) -> None:
    """Each section's log into one gzipped tar, the last ``LOG_TAIL_BYTES`` of a longer one."""
    import io
    import tarfile

    from dit.io.atomic import atomic_write_bytes

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for log in sorted(logs.glob("*.log")):
            data = log.read_bytes()[-LOG_TAIL_BYTES:]
            info = tarfile.TarInfo(f"logs/{log.name}")
            info.size, info.mtime = len(data), int(log.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    atomic_write_bytes(archive, buffer.getvalue())


@dataclass(frozen=True)
class ValidateConfig(Section):
    """One section of scripts/gpu_validate.sh, or ``finish SECTION`` after its process."""

    work: str = option(help="the scratch folder: records, logs, work")
    section: str = option(choices=(*SECTIONS, "finish"), positional=True, help="the section to run, or finish")
    name: str | None = option(None, f"finish: the section ({', '.join(SECTIONS)})", positional=True)
    out: str | None = option(None, "finish: the folder the results come back in")
    dry_run: bool = option(False, "the CPU, tiny shapes")
    budget: float = option(600.0, "seconds this section may take", gt=0)
    fail: bool = option(False, "fail at once (tests that the others still run)")
    rc: int = option(0, "finish: the section process's exit status")
    seconds: float | None = option(None, "finish: how long it ran", ge=0)

    def check(self) -> None:
        if self.section == "finish" and (self.name not in SECTIONS or self.out is None):
            raise FieldError(f"finish needs a section's name ({', '.join(SECTIONS)}) and --out, got {self.name}.")


FACE = Face(
    "scripts/gpu_validate.py",
    __doc__,
    sections={"validate": ValidateConfig},
    outputs={"work": "folder", "out": "folder"},
)


def main(argv=None) -> int:
    a = FACE.parse(argv).sections["validate"]
    if a.section == "finish":
        return finish(a.name, Path(a.work), Path(a.out), a.rc, a.seconds, a.dry_run)
    return run_section(a.section, Path(a.work), a.dry_run, a.budget, a.fail)


if __name__ == "__main__":
    sys.exit(run_cli(main))
