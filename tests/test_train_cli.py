"""train.py as users run it: torchrun with two processes, preemption by a stop signal, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dit.checkpoint import latest_checkpoint, load_checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir()
        for i in range(8):
            Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    return root


def train_args(data, out, steps, *extra):
    return [
        "train.py",
        "--data-path", str(data),
        "--vae", "none",
        "--model", "DiT-S/2",
        "--depth", "2",
        "--hidden-size", "32",
        "--num-heads", "2",
        "--image-size", "8",
        "--num-classes", "2",
        "--global-batch-size", "8",
        "--max-steps", str(steps),
        "--precision", "fp32",
        "--num-workers", "0",
        "--log-every", "1",
        "--lr", "1e-3",
        "--peak-tflops", "0.05",
        "--results-dir", str(out),
        *extra,
    ]  # fmt: skip


def wait_for_log_steps(metrics: Path, running, idle=lambda: time.sleep(0.2)) -> None:
    """Until the run has written three metrics records, however long a loaded machine takes to start it (a run
    signalled before its first step would save nothing); a run that ended, or stalled for 15 minutes, fails."""
    deadline = time.time() + 900
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
        assert running() and time.time() < deadline, "the run ended or stalled before its third log step"
        idle()


def run(args, **kw):
    """A face's process; a rank's fatal signal prints every thread's Python stack (PYTHONFAULTHANDLER)."""
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=env, **kw
    )


@pytest.mark.parametrize("world", ["2", "1"])
def test_a_rank_ends_after_its_exit_handlers_without_the_interpreters_teardown(world):
    """A rank (WORLD_SIZE > 1) runs the exit handlers and flushes, then skips the teardown, where torch's group
    threads can abort it; one process ends as Python ends."""
    code = (
        "import atexit\nfrom dit.io.cli import exit_process\n"
        "class Teardown:\n    def __del__(self):\n        print('teardown', flush=True)\n"
        "kept = Teardown()\natexit.register(print, 'exit handler', flush=True)\n"
        "print('buffered', end='')\nexit_process(3)\n"
    )
    env = {**os.environ, "WORLD_SIZE": world}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith("bufferedexit handler") and ("teardown" in done.stdout) == (world == "1")


# token drop: each rank takes its samples' rows of the global batch's kept sets
@pytest.mark.parametrize("extra", [(), ("--depth", "5", "--token-drop", "0.5")], ids=["plain", "token-drop"])
def test_two_processes_equal_one(image_folder, tmp_path, extra):
    one = run(train_args(image_folder, tmp_path / "one", 3, *extra))
    assert one.returncode == 0, one.stderr
    two = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            *train_args(image_folder, tmp_path / "two", 3, *extra),
        ]
    )
    assert two.returncode == 0, two.stderr
    assert "2 process(es)" in two.stderr
    a = load_checkpoint(latest_checkpoint(tmp_path / "one" / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(tmp_path / "two" / "checkpoints"))
    assert a["step"] == b["step"] == 3
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5, msg=k)
    assert torch.count_nonzero(a["model"]["final_layer.linear.weight"]) > 0
    losses_one = [json.loads(x)["loss"] for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    losses_two = [json.loads(x)["loss"] for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert losses_one == pytest.approx(losses_two, rel=1e-4)  # the logged loss is the mean over all ranks


@pytest.mark.parametrize(
    "sig,code",
    [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129), (signal.SIGUSR1, 128 + signal.SIGUSR1)],
)  # SIGHUP: a dropped ssh session (it was exit 129 with no save); SIGUSR1: SLURM's warning, 138 on Linux
def test_sigterm_saves_and_resume_auto_continues(image_folder, tmp_path, sig, code):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, *train_args(image_folder, out, 100000)], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    wait_for_log_steps(out / "metrics.jsonl", lambda: proc.poll() is None)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == code, err  # a stopped run is told apart from a finished one (0)
    assert f"stopped by {sig.name}" in err
    saved = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    assert saved["step"] >= 3
    resumed = run(train_args(image_folder, out, saved["step"] + 2, "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {saved['step']} (" in resumed.stderr
    assert load_checkpoint(latest_checkpoint(out / "checkpoints"))["step"] == saved["step"] + 2


def test_bad_input_exits_nonzero_without_traceback(image_folder, tmp_path):
    missing = run(train_args(tmp_path / "nowhere", tmp_path / "r1", 2))
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "error:" in missing.stderr and "nowhere" in missing.stderr
    fp16 = run(train_args(image_folder, tmp_path / "r2", 2, "--precision", "fp16"))
    assert fp16.returncode == 2 and "fp16 needs a CUDA device" in fp16.stderr
    classes = run(train_args(image_folder, tmp_path / "r3", 2, "--num-classes", "1"))
    assert classes.returncode == 2 and "--num-classes 2" in classes.stderr


def test_fsdp_matches_one_process_and_resumes_a_ddp_checkpoint(image_folder, tmp_path):
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    one = run(train_args(image_folder, tmp_path / "one", 3))
    assert one.returncode == 0, one.stderr
    fsdp = run([*torchrun, *train_args(image_folder, tmp_path / "fsdp", 3, "--fsdp", "--sample-every", "3")])
    assert fsdp.returncode == 0, fsdp.stderr
    a = load_checkpoint(latest_checkpoint(tmp_path / "one" / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(tmp_path / "fsdp" / "checkpoints"))
    assert (
        a["model"].keys() == b["model"].keys() and a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    )
    for part in ("model", "ema"):
        for k in a[part]:
            torch.testing.assert_close(a[part][k], b[part][k], rtol=1e-4, atol=1e-5, msg=f"{part} {k}")
    # a single-process checkpoint continues under FSDP exactly as it continues alone
    cont = run(
        [
            *torchrun,
            *train_args(
                image_folder,
                tmp_path / "cont",
                4,
                "--fsdp",
                "--resume",
                str(latest_checkpoint(tmp_path / "one" / "checkpoints")),
            ),
        ]
    )
    assert cont.returncode == 0, cont.stderr
    alone = run(train_args(image_folder, tmp_path / "one", 4, "--resume", "auto"))
    assert alone.returncode == 0, alone.stderr
    c = load_checkpoint(latest_checkpoint(tmp_path / "cont" / "checkpoints"))
    d = load_checkpoint(latest_checkpoint(tmp_path / "one" / "checkpoints"))
    assert c["step"] == d["step"] == 4
    for k in d["model"]:
        torch.testing.assert_close(c["model"][k], d["model"][k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_two_nodes_train_to_the_same_weights_as_one_process(image_folder, tmp_path):
    """The README's multi-node recipe, exercised: two torchrun agents (one process each) meet through the c10d
    rendezvous on 127.0.0.1, as two nodes do over a network, and train the same model as one process."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one = run(train_args(image_folder, tmp_path / "one", 3))
    assert one.returncode == 0, one.stderr
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
    agent += ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=dit-test"]
    nodes = [
        subprocess.Popen(
            [*agent, *train_args(image_folder, tmp_path / "nodes", 3)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    assert any("2 process(es)" in err for _, err in outputs)
    a = load_checkpoint(latest_checkpoint(tmp_path / "one" / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(tmp_path / "nodes" / "checkpoints"))
    assert a["step"] == b["step"] == 3
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_to_the_process_group_with_loader_workers_is_a_stop(image_folder, tmp_path, sig, code):
    """SLURM, `timeout` and Ctrl-C signal every process of the group: the loader workers ignore it and the
    main process saves and exits as for a signal to it alone (a worker's death was a traceback, exit 1)."""
    out = tmp_path / "run"
    args = train_args(image_folder, out, 100000, "--num-workers", "2")
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    wait_for_log_steps(out / "metrics.jsonl", lambda: proc.poll() is None)
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == code, err
    assert "Traceback" not in err and f"stopped by {sig.name}" in err
    assert load_checkpoint(latest_checkpoint(out / "checkpoints"))["step"] >= 3


def test_a_dropped_terminal_saves(image_folder, tmp_path):
    """An ssh session that drops under a run started without nohup or tmux: the terminal hangs up (SIGHUP, and
    every later write to it fails). The run leaves the terminal, saves and exits 129; it was exit 1, unsaved."""
    import pty
    import select

    out = tmp_path / "run"
    pid, terminal = pty.fork()  # the run's controlling terminal: closing our end hangs it up
    if pid == 0:
        os.execv(sys.executable, [sys.executable, *train_args(image_folder, out, 100000)])

    def drain():  # what the terminal shows, read so the run never blocks on it
        if select.select([terminal], [], [], 0.2)[0]:
            os.read(terminal, 65536)

    wait_for_log_steps(out / "metrics.jsonl", lambda: os.waitpid(pid, os.WNOHANG) == (0, 0), drain)
    os.close(terminal)
    _, status = os.waitpid(pid, 0)
    log = (out / "log.txt").read_text()
    assert os.waitstatus_to_exitcode(status) == 129, log[-2000:]
    step = load_checkpoint(latest_checkpoint(out / "checkpoints"))["step"]
    assert step >= 3 and f"stopped by SIGHUP at step {step}" in log


def test_fsdp_in_bf16_computes_what_ddp_does_and_bf16_gradients_train(image_folder, tmp_path):
    """FSDP's bf16 weights (gathered in bf16, reduced in float32, inputs not cast) compute what DDP's autocast
    does; DDP's bf16 gradient all-reduce (--ddp-bf16-grads) trains, its rounding within 1e-2 of float32's."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    runs = {"ddp": [], "fsdp": ["--fsdp"], "bf16_grads": ["--ddp-bf16-grads"]}
    for name, extra in runs.items():
        done = run([*torchrun, *train_args(image_folder, tmp_path / name, 3, "--precision", "bf16", *extra)])
        assert done.returncode == 0, done.stderr
    ckpt = {name: load_checkpoint(latest_checkpoint(tmp_path / name / "checkpoints")) for name in runs}
    loss = {
        n: [json.loads(x)["loss"] for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in runs
    }
    for k, want in ckpt["ddp"]["model"].items():
        torch.testing.assert_close(ckpt["fsdp"]["model"][k], want, rtol=1e-4, atol=1e-5, msg=k)
    assert loss["fsdp"] == pytest.approx(loss["ddp"], rel=1e-4)
    assert loss["bf16_grads"] == pytest.approx(loss["ddp"], rel=1e-2)
    moved = ckpt["bf16_grads"]["model"]["final_layer.linear.weight"]
    assert torch.count_nonzero(moved) > 0 and not torch.equal(
        moved, ckpt["ddp"]["model"]["final_layer.linear.weight"]
    )
