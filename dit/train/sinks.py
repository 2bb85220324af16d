"""Where the ledger's records go: ``Sink``s behind one fan-out. The console with ``log.txt`` and ``metrics.jsonl``
are always kept; ``--sinks`` adds TensorBoard and each ``dit/train/sinks_NAME.py``'s ``SINK``."""

from __future__ import annotations

import json
import math
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import yaml

from dit.io.atomic import CannotWrite, utc_now
from dit.io.progress import write


class Sink(Protocol):
    """One place the records go, on rank 0 (``scalars``, ``image``, ``text``); a refused write names ``path``."""

    path: Path
    options = None  # a frozen Section of the sink's own flags (W&B's project), or None

    def scalars(self, record: dict, step: int) -> None: ...
    def image(self, tag: str, image_chw, step: int) -> None: ...
    def text(self, message: str, stamp: str) -> None: ...
    def close(self) -> None: ...


def numbers(record: dict) -> dict:
    """A record's numbers as ``KIND/key``, KIND its ``kind``: what the sinks that plot them show."""
    group = record.get("kind", "train")
    return {f"{group}/{k}": v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}  # fmt: skip


class _Lines(Sink):
    """An appended file of ``name``, line-buffered: each line is on disk as it is written."""

    name = ""

    def __init__(self, section, out: Path, record: dict, start: int):
        self.path = out / self.name
        self.file = open(self.path, "a", buffering=1)

    def close(self) -> None:
        self.file.close()


class Log(_Lines):
    """The console as it is, and log.txt with each line's UTC time (to line a run up with a cluster's events)."""

    name = "log.txt"

    def text(self, message: str, stamp: str) -> None:
        write(message)
        self.file.write("".join(f"{stamp} {line}\n" for line in message.split("\n")))


class Metrics(_Lines):
    """metrics.jsonl: each record a JSON line, a non-finite number as null (JSON has no NaN)."""

    name = "metrics.jsonl"

    def scalars(self, record: dict, step: int) -> None:
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")


def _quiet_tensorboard_thread() -> None:
    """Silence TensorBoard's writer thread: the write it re-raises in the next log is the one line."""
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args):
        if type(args.thread).__name__ != "_AsyncWriterThread" or not issubclass(args.exc_type, OSError):
            previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


class TensorBoard(Sink):
    """Event files in tensorboard/: numbers (with TensorBoard's own wall time), images, the configuration."""

    def __init__(self, section, out: Path, record: dict, start: int):
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_thread()
        self.path = out / "tensorboard"
        self.writer = SummaryWriter(str(self.path))
        self.writer.add_text("config", yaml.safe_dump(record, sort_keys=False), 0)

    def scalars(self, record: dict, step: int) -> None:
        for key, value in numbers(record).items():
            self.writer.add_scalar(key, value, step)

    def image(self, tag: str, image_chw, step: int) -> None:
        self.writer.add_image(tag, image_chw, step)

    def close(self) -> None:
        self.writer.close()


class Sinks:
    """What the ledger writes to: ``Log``, ``Metrics`` and the ``chosen`` sinks, on rank 0 only."""

    CONSOLE_KEYS = ("step", "loss", "grad_norm", "steps_per_sec", "images_per_sec", "mfu", "hfu",
                    "host_data_wait_frac")  # fmt: skip

    def __init__(self, section, out: str | Path, record: dict, chosen=(), start: int = 0, enabled: bool = True):
        self.out, self.sinks = Path(out), []
        if enabled:
            with self._writing(self.out):
                self.out.mkdir(parents=True, exist_ok=True)
                self.sinks = [kind(section, self.out, record, start) for kind in (Log, Metrics, *chosen)]

    @contextmanager
    def _writing(self, path: Path):
        """A refused write is the one line (the run adds which checkpoints are kept), not a traceback."""
        try:
            yield
        except OSError as e:
            raise CannotWrite(path, e) from None

    def _each(self, method: str, *args) -> None:
        for sink in self.sinks:
            with self._writing(sink.path):
                getattr(sink, method)(*args)

    def info(self, message: str, stamp: str | None = None) -> None:
        self._each("text", message, stamp or utc_now())

    def log(self, record: dict, console_keys: tuple[str, ...] = CONSOLE_KEYS) -> None:
        """One record to every sink, with its ``time``, and a line of ``console_keys`` at the same time."""
        stamp = utc_now()
        self._each("scalars", {**record, "time": stamp}, record["step"])
        group = record.get("kind", "train")
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k in console_keys if (v := record.get(k)) is not None)  # fmt: skip
        self.info(shown if group == "train" else f"{group}: {shown}", stamp)

    def image(self, tag: str, image_chw, step: int) -> None:
        self._each("image", tag, image_chw, step)

    def close(self) -> None:
        self._each("close")
