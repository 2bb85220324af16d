"""Launchers other than torchrun: accelerate launch runs what it was asked for, or says in one line why not."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_image_folder

from dit.checkpoint import latest_checkpoint, load_checkpoint
from dit.io.errors import UserError

REPO = Path(__file__).resolve().parents[1]
TINY_RUN = ["--model", "DiT-S/8", "--depth", "2", "--hidden-size", "64", "--num-heads", "2", "--patch-size", "4",
            "--image-size", "16", "--num-classes", "2", "--vae", "none", "--max-steps", "2", "--log-every", "1", "--global-batch-size", "4",
            "--num-workers", "0"]  # fmt: skip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("accelerate", path=str(Path(sys.executable).parent)) is None,
                       reason="accelerate is a test dependency ([dev]): pip install -e '.[dev]'"),
]  # fmt: skip


def accelerate(tmp_path, *launch_args, extra=()):
    images = Path(make_image_folder(tmp_path / "images", counts={"a": 4, "b": 4}))
    for problem in (images / "a" / "broken.jpg", images / "a" / "notes.txt"):  # the helper's deliberate faults
        problem.unlink()
    (images / "c_empty").rmdir()
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--cpu", "--num_machines", "1",
           "--dynamo_backend", "no", *launch_args, str(REPO / "train.py"), *TINY_RUN, "--data-path", str(images),
           "--results-dir", str(tmp_path / "run"), *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_more_processes_than_started_is_refused_naming_torchrun(tmp_path):
    """On CPUs accelerate starts one process for --num_processes 2 (multi-CPU needs mpirun): refused."""
    proc = accelerate(tmp_path, "--num_processes", "2", "--mixed_precision", "fp16")
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(ours) == 1, proc.stderr
    assert "asked for 2 processes but this job has 1" in ours[0] and "torchrun --nproc_per_node=2" in ours[0]
    before = proc.stderr[: proc.stderr.index(ours[0])]
    assert "Traceback" not in before, "our process ends with the line, not a traceback"  # accelerate adds its own
    assert (
        not (tmp_path / "run" / "checkpoints").exists()
        or latest_checkpoint(tmp_path / "run" / "checkpoints") is None
    )


def test_mixed_precision_is_honoured_or_refused(tmp_path):
    """--mixed_precision bf16 trains in bf16 (said at start-up and recorded); against --precision it is refused."""
    proc = accelerate(tmp_path, "--num_processes", "1", "--mixed_precision", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert "1 process(es)" in proc.stderr and "peak for bf16" in proc.stderr
    saved = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert saved["config"]["runtime"]["precision"] == "bf16"
    clash = accelerate(
        tmp_path / "clash", "--num_processes", "1", "--mixed_precision", "bf16", extra=["--precision", "fp32"]
    )
    ours = [line for line in clash.stderr.splitlines() if line.startswith("error:")]
    assert clash.returncode != 0 and len(ours) == 1 and "--precision fp32" in ours[0] and "bf16" in ours[0]


@pytest.mark.parametrize(
    "env,match",
    [
        ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT not"),
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not a whole number"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "outside WORLD_SIZE=2"),
        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1'"),
    ],
)
def test_a_bad_process_environment_is_one_line_naming_torchrun(monkeypatch, env, match):
    from dit.runtime import Runtime

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=match) as e:
        Runtime("cpu")
    assert "torchrun" in str(e.value)


def _free_port() -> int:
    """A port no one listens on now (the kernel's pick), so another job's server is never taken for a rank."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hand_started(rank: int, port: int, timeout_s: str) -> subprocess.Popen:
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "DIT_RENDEZVOUS_TIMEOUT_S": timeout_s}  # fmt: skip
    code = (  # a face: run_cli prints a UserError as one line
        "from dit.io.cli import run_cli\nfrom dit.runtime import Runtime\ndef main(argv):\n"
        "    with Runtime('cpu') as rt:\n        print(rt.rank, rt.world)\n    return 0\n"
        "raise SystemExit(run_cli(main, []))"
    )
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_ranks_started_by_hand_form_a_group_and_a_missing_rank_is_a_bounded_wait():
    """Without torchrun (srun, a hand-set environment) the group still forms; a rank that never comes is one
    line after DIT_RENDEZVOUS_TIMEOUT_S, not torch's silent 30 minutes."""
    port = _free_port()
    procs = [_hand_started(r, port, "600") for r in (0, 1)]  # the ranks start apart on a loaded machine
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(o.strip() for o, _ in outs) == ["0 2", "1 2"]
    alone = _hand_started(0, _free_port(), "3")  # port + 1 may be another job's
    out, err = alone.communicate(timeout=600)
    assert alone.returncode != 0 and "Traceback" not in err
    assert "did not meet the others" in err and "within 3 s" in err
