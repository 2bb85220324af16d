"""Metric sinks: the console, TensorBoard and ``metrics.jsonl``; each gets the same dict per log step."""

from __future__ import annotations

import json
import math
import threading
from contextlib import contextmanager
from pathlib import Path

from dit.atomic import cannot_write, utc_now
from dit.progress import write


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


@contextmanager
def _writing(path: Path, checkpoints: Path):
    """A write the OS refuses (a full disk: the line-buffered files, TensorBoard's event file) is the one
    line that names what is kept, not a traceback from inside the log call."""
    try:
        yield
    except OSError as e:
        raise cannot_write(path, e, checkpoints) from None


def _quiet_tensorboard_thread() -> None:
    """TensorBoard's writer thread re-raises a failed write (a full disk) in the next log call, which
    ``_writing`` turns into the one line; the thread's own traceback, printed as it dies, would be a second
    report of the same error."""
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args):
        if type(args.thread).__name__ != "_AsyncWriterThread" or not issubclass(args.exc_type, OSError):
            previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


class MetricSinks:
    """Writes on rank 0 only; other ranks get a no-op object with the same methods."""

    CONSOLE_KEYS = (
        "step",
        "loss",
        "grad_norm",
        "steps_per_sec",
        "images_per_sec",
        "mfu",
        "hfu",
        "host_data_wait_frac",
    )

    def __init__(self, out_dir: str | Path, enabled: bool = True):
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self.writer = None
        self.jsonl = None
        self.checkpoints = self.out_dir / "checkpoints"
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_thread()
        with _writing(self.out_dir, self.checkpoints):
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(self.out_dir / "metrics.jsonl", "a", buffering=1)
            self.log_file = open(self.out_dir / "log.txt", "a", buffering=1)
            self.writer = SummaryWriter(str(self.out_dir / "tensorboard"))

    def info(self, message: str, stamp: str | None = None):
        """A line for people: the console as it is, and log.txt with the time (``utc_now``) before each line,
        for lining a run up with a cluster's events (the console is watched live, or has its own times)."""
        if self.enabled:
            write(message)
            stamp = stamp or utc_now()
            with _writing(self.out_dir / "log.txt", self.checkpoints):
                self.log_file.write("".join(f"{stamp} {line}\n" for line in message.split("\n")))

    def log(self, metrics: dict, console_keys: tuple[str, ...] = CONSOLE_KEYS):
        """One record to metrics.jsonl (with its ``time``), TensorBoard (as ``KIND/key``, KIND the record's
        ``kind``; it keeps its own wall time) and a line."""
        if not self.enabled:
            return
        stamp = utc_now()
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        clean["time"] = stamp
        with _writing(self.out_dir / "metrics.jsonl", self.checkpoints):
            self.jsonl.write(json.dumps(clean) + "\n")
        group = metrics.get("kind", "train")
        if self.writer is not None:
            with _writing(self.out_dir / "tensorboard", self.checkpoints):
                for k, v in metrics.items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and v is not None:
                        self.writer.add_scalar(f"{group}/{k}", v, metrics["step"])
        shown = " ".join(f"{k}={_fmt(metrics[k])}" for k in console_keys if metrics.get(k) is not None)
        self.info(shown if group == "train" else f"{group}: {shown}", stamp)

    def text(self, tag: str, text: str, step: int = 0):
        if self.writer is not None:
            with _writing(self.out_dir / "tensorboard", self.checkpoints):
                self.writer.add_text(tag, text, step)

    def image(self, tag: str, image_chw, step: int):
        if self.writer is not None:
            with _writing(self.out_dir / "tensorboard", self.checkpoints):
                self.writer.add_image(tag, image_chw, step)

    def close(self):
        if self.enabled:
            with _writing(self.out_dir, self.checkpoints):
                self.jsonl.close()
                self.log_file.close()
                if self.writer is not None:
                    self.writer.close()
