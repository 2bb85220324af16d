"""What a newcomer meets on the way in: readable help, readable logs in a file, pipes, and sane defaults."""

import ast
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dit.io import progress
from dit.runtime import default_workers

REPO = Path(__file__).resolve().parents[1]
HELP_FACES = [
    [sys.executable, "train.py", "--help"],
    [sys.executable, "sample.py", "--help"],
    [sys.executable, "extract_features.py", "--help"],
    [sys.executable, "scripts/sample_ddp.py", "--help"],
    [sys.executable, "-m", "dit.eval", "--help"],
    [sys.executable, "-m", "dit.quickstart", "--help"],
    [sys.executable, "-m", "dit.cost", "train", "--help"],
]


@pytest.mark.parametrize("cmd", HELP_FACES, ids=lambda c: " ".join(c[1:]))
def test_help_says_each_default_once_and_keeps_example_lines(cmd):
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    entries, options = [], out.stdout.split("\noptions:", 1)[-1]
    for line in options.splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif entries:
            entries[-1] += " " + line.strip()
    assert len(entries) > 3, out.stdout
    for entry in entries:
        assert "(default: None)" not in entry, "a None default says nothing"
        if "(default:" in entry:  # the text before it (after the flag and its choices) must not speak of it
            before = entry.split("(default:")[0].split("}")[-1]
            assert "default" not in before.lower(), f"the default said twice: {entry}"


def test_docstring_examples_stay_one_per_line():
    out = subprocess.run(
        [sys.executable, "sample.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    lines = out.stdout.splitlines()
    assert any(line.startswith("python sample.py --ckpt") for line in lines), out.stdout
    assert sum(line.startswith("python sample.py") for line in lines) >= 2


def test_a_closed_pipe_ends_the_output_not_with_a_traceback():
    proc = subprocess.run(
        f"{sys.executable} -m dit.cost peaks | head -n 2", shell=True, cwd=REPO, capture_output=True, text=True,
        timeout=120, executable="/bin/bash",
    )  # fmt: skip
    assert (
        len(proc.stdout.splitlines()) == 2 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    )


def test_progress_off_a_terminal_is_whole_lines_at_an_interval(monkeypatch, capsys):
    """No carriage-return frames in a log: a line per tenth of the work (at most one per 5 s) and one at the end."""
    clock = iter(float(t) for t in range(0, 10_000, 3))
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    with progress.progress(100, "train", unit="step") as bar:
        assert isinstance(bar, progress.PlainProgress)
        for _ in range(100):
            bar.update(1)
    text = sys.stderr.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and 2 <= len(lines) <= 12, lines
    assert lines[-1].startswith("train: 100/100 step (100%)") and "ETA" in lines[0]
    assert len(set(lines)) == len(lines), "no line printed twice"


def test_the_default_loader_workers_fit_the_machine():
    assert 1 <= default_workers() <= min(4, len(os.sched_getaffinity(0)))


def test_scripts_write_under_out_unless_told_otherwise():
    """A script run with its defaults must not overwrite committed evidence (docs/) or test data (tests/)."""
    offenders = []
    for path in [*REPO.glob("scripts/*.py"), *REPO.glob("studies/*.py"), *(REPO / "dit").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "option" and node.args:
                default = node.args[0]
                if isinstance(default, ast.Constant) and isinstance(default.value, str):
                    if default.value.startswith(("docs/", "tests/", "dit/")):
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {default.value}")
    assert not offenders, offenders
