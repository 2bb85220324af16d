"""Atomic file writes and folder locks: every file a crash must not corrupt is written here, one way."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from dit.io.errors import REFUSED, UserError

TEMP_MARK = ".tmp-"  # NAME.tmp-XXXXXXXX beside NAME while it is written


def utc_now() -> str:
    """Now in UTC, ISO-8601 to the millisecond: the one time format of a run's records (log, metrics, lock)."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _umask() -> int:
    """The process umask, read without setting it where Linux tells it (setting it races other threads)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
        return mask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """``write(file)`` into ``NAME.tmp-*`` beside ``path``, fsync, rename, fsync the folder: a crash leaves the old
    file or the new one, in an ordinary ``open``'s mode; an OS error is a ``CannotWrite``."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{path.name}{TEMP_MARK}", dir=path.parent)
    except OSError as e:
        raise CannotWrite(path, e) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CannotWrite(path, e) from None
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # makes the rename itself durable
    finally:
        os.close(folder)
    return path


class CannotWrite(UserError):
    """The one line for a write the OS refused: the path, the fix and what is kept (``keeping``)."""

    def __init__(self, path: str | os.PathLike, error: OSError, kept: str | None = None):
        self.path, self.error, self.kept = Path(path), error, kept
        # os.path, not Path: it never raises (a name too long for Path.exists is an OSError of its own)
        if kept is None:
            kept = "the earlier file there is intact" if os.path.exists(path) else "nothing partial was left there"
        fix = REFUSED.get(error.errno, "check the path")
        super().__init__(f"cannot write {path}: {error.strerror or error}. {fix.capitalize()}; {kept}.")

    def __reduce__(self):  # across processes (a loader worker, a rank) as it was made
        return CannotWrite, (self.path, self.error, self.kept)

    def keeping(self, kept: str) -> CannotWrite:
        """The same refusal, saying ``kept`` instead."""
        return CannotWrite(self.path, self.error, kept)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def stale_temp_files(folder: str | os.PathLike, name_prefix: str = "") -> list[Path]:
    """Temporary files of writes that a killed process never finished (only safe to delete under a lock)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if TEMP_MARK in p.name and p.name.startswith(name_prefix))


class FolderLock:
    """An exclusive ``flock`` on ``FOLDER/.lock`` that dies with its process; a stale file is taken over."""

    def __init__(self, folder: str | os.PathLike, purpose: str, fix: str):
        self.path = Path(folder) / ".lock"
        self.purpose, self.fix = purpose, fix
        self.took_over: dict | None = None
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        except OSError as e:
            raise CannotWrite(self.path, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if not isinstance(e, BlockingIOError):  # ENOLCK, ENOSYS: a file system without flock (some NFS)
                os.close(fd)
                raise UserError(
                    f"cannot lock {self.path}: {e.strerror or e}. This file system has no file locks: use a folder "
                    "on a local or lock-capable file system."
                ) from None
            holder = _read_holder(fd)
            os.close(fd)
            raise UserError(
                f"{self.path.parent} is in use by another {self.purpose} (pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}, since {holder.get('since', '?')}): {self.fix}."
            ) from None
        self.took_over = _read_holder(fd) or None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": utc_now()})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
        except OSError as e:  # a full disk at start-up
            os.close(fd)
            raise CannotWrite(self.path, e, kept=f"nothing was written for this {self.purpose}") from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # an empty file: nobody to take over from
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __del__(self):  # a lock object dropped without release (an exception) must not outlive its holder
        self.release()

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
