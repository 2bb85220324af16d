"""Which checkpoints of a run folder continue which, so that a rollback is never undone by a requeue: a resume from
anything but ``--resume auto``'s pick starts a branch, and the checkpoints off its line are set aside."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from dit import __version__
from dit.checkpoint.format import FORMAT, checksum_path, list_checkpoints, read_record, verify_checkpoint
from dit.checkpoint.posthoc import set_aside_snapshots
from dit.io.atomic import atomic_write_bytes
from dit.io.errors import WRITER_KEY, UserError, refuse_newer_format
from dit.io.userfiles import inside

HEAD = "branch.json"
HEAD_FORMAT = "dit-ledger-branch/1"
ABANDONED = "abandoned"
_LINEAGE: dict[tuple, dict | None] = {}


def read_lineage(path: Path) -> dict | None:
    """A checkpoint's lineage (None: none recorded, or unreadable), read with its weights mapped and not hashed."""
    stat = path.stat()
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _LINEAGE:
        ckpt = read_record(path)
        # a newer dit-ledger's lineage may be laid out otherwise: the folder is its to continue
        refuse_newer_format(path, "checkpoint", ckpt.get("format"), FORMAT, ckpt.get(WRITER_KEY))
        lineage = ckpt.get("lineage")
        if isinstance(lineage, dict):  # its branch names the folder it is kept aside in: one name, no path
            fix = "a branch is an id dit-ledger writes; move that checkpoint out of the folder"
            inside(path.parent / ABANDONED, lineage.get("branch") or "unrecorded", path, "branch", fix, True)
        _LINEAGE[key] = lineage if isinstance(lineage, dict) else None
    return _LINEAGE[key]


def branch_of(lineage: dict | None) -> str:
    return lineage["branch"] if lineage else ""


def on_line(branch: str, step: int, line: dict, upto: int | None = None) -> bool:
    """Whether ``branch`` at ``step`` is an ancestor of ``line``, or on its own branch up to step ``upto``."""
    if branch == line["branch"]:
        return upto is None or step <= upto
    return step <= line["forks"].get(branch, -1)


def read_head(folder: Path) -> dict | None:
    path = Path(folder) / HEAD
    try:
        head = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet (a run from before lineage), or damaged: judged by the records
        return None
    if isinstance(head, dict):  # one without a format is from before it was recorded: the same layout
        refuse_newer_format(path, "branch record", head.get("format"), HEAD_FORMAT, head.get(WRITER_KEY))
    return head if isinstance(head, dict) and {"branch", "forks"} <= head.keys() else None


def _pick(folder: Path) -> tuple[Path | None, list[Path], list[Path]]:
    """(the checkpoint to continue, the newer ones on its line that fail, each branch's newest when unrecorded)."""
    folder, found = Path(folder), list_checkpoints(folder)
    head = read_head(folder)
    if head is None:
        lines = [(s, p, read_lineage(p) or {"branch": "", "forks": {}}) for s, p in found]
        tips = [p for s, p, line in lines
                if not any(q != p and on_line(line["branch"], s, other, t) for t, q, other in lines)]  # fmt: skip
        if len(tips) > 1:
            return None, [], tips
        candidates = found
    else:
        candidates = [(s, p) for s, p in found if on_line(branch_of(read_lineage(p)), s, head)]
    bad = []
    for _, path in reversed(candidates):
        if verify_checkpoint(path) is not False:
            return path, bad, []
        bad.append(path)
    parent = (head or {}).get("parent")
    if isinstance(parent, dict):  # a branch resumed here, none saved yet: a parent outside is not followed
        fix = "pass --resume PATH with the checkpoint to continue"
        path = inside(folder, parent.get("path"), folder / HEAD, "parent path", fix)
        if path.is_file():
            return path, bad, []
    return None, bad, []


def follow(folder: Path) -> tuple[Path | None, list[Path]]:
    """``--resume auto``'s pick: the newest that verifies on the last branch's line, and newer ones that fail."""
    path, bad, tips = _pick(folder)
    if tips:
        raise UserError(
            f"{folder} holds {len(tips)} branches of the run and no {HEAD} to say which ran last; their newest "
            f"checkpoints are {', '.join(p.name for p in tips)}: pass --resume PATH with the one to continue "
            f"(the others are moved to {ABANDONED}/, nothing is deleted)."
        )
    if path is None and not bad and list_checkpoints(folder):
        raise UserError(
            f"{folder} holds no checkpoint of the branch that ran last ({HEAD}: {read_head(folder)['branch']}): "
            "pass --resume PATH with the checkpoint to continue."
        )
    return path, bad


def plan_segment(folder: Path, resume_from: Path | None, ckpt: dict | None) -> tuple[dict, list[tuple[Path, str]]]:
    """This segment's lineage, and the folder's checkpoints off its line (path, branch), to be moved aside."""
    if resume_from is None:
        return {"branch": secrets.token_hex(4), "forks": {}, "parent": None}, []
    folder, step = Path(folder), int(ckpt["step"])
    parent_lineage, head = ckpt.get("lineage"), read_head(folder)
    pick = _pick(folder)[0]
    continues = pick is not None and os.path.samefile(pick, resume_from)
    if continues and (head is not None or parent_lineage is not None):
        base = head if head is not None else parent_lineage
        line = {"branch": base["branch"], "forks": dict(base["forks"])}
    else:  # a rollback, or the first segment to record lineage: a new branch forked at this step
        forks = dict(parent_lineage["forks"]) if parent_lineage else {}
        line = {"branch": secrets.token_hex(4), "forks": {**forks, branch_of(parent_lineage): step}}
    sums = checksum_path(resume_from)
    line["parent"] = {
        "file": resume_from.name,
        "path": os.path.relpath(resume_from, folder),
        "step": step,
        "sha256": sums.read_text().split()[0] if sums.is_file() else None,
        "branch": branch_of(parent_lineage),
    }
    off = []
    for s, path in list_checkpoints(folder):
        branch = branch_of(read_lineage(path))
        if not os.path.samefile(path, resume_from) and not on_line(branch, s, line, upto=step):
            off.append((path, branch))
    return line, off


def begin_segment(folder: Path, line: dict, off: list[tuple[Path, str]]) -> list[str]:
    """Record ``line`` as the running branch and move ``off`` to ``abandoned/BRANCH/``; lines for the log."""
    folder, parent = Path(folder), line["parent"]
    if parent is None:  # a fresh run is one branch, the newest checkpoint its tip: a stale record is dropped
        (folder / HEAD).unlink(missing_ok=True)
    else:
        record = {"format": HEAD_FORMAT, WRITER_KEY: __version__, **line}
        atomic_write_bytes(folder / HEAD, json.dumps(record, indent=1).encode())
    moved: dict[Path, list[str]] = {}
    for path, branch in off:
        base = dest = folder / ABANDONED / (branch or "unrecorded")
        k = 1
        while (dest / path.name).exists():  # the same step of that branch kept aside before: another folder
            k += 1
            dest = base.with_name(f"{base.name}.{k}")
        dest.mkdir(parents=True, exist_ok=True)
        if checksum_path(path).is_file():  # a sharded folder moves whole
            os.replace(checksum_path(path), checksum_path(dest / path.name))
        os.replace(path, dest / path.name)
        moved.setdefault(dest, []).append(path.name)
    notes = []
    if (
        parent is not None
        and parent["branch"] != line["branch"]
        and line["forks"].get(parent["branch"]) == parent["step"]
    ):
        notes.append(
            f"branch {line['branch']} begins at step {parent['step']} ({parent['file']}, branch "
            f"{parent['branch'] or 'unrecorded'}); --resume auto follows it from here on"
        )
    notes += set_aside_snapshots(folder, parent["step"] if parent is not None else 0)
    for dest, names in moved.items():
        notes.append(
            f"kept aside the checkpoints off this branch's line: {', '.join(names)} in {dest} (nothing deleted; "
            "--resume PATH continues one of them)"
        )
    return notes
