"""An FSDP run's sharded checkpoints (torch.distributed.checkpoint), as users run it: torchrun with two processes
(issue 33 item 5). Every property of the one-file checkpoints holds for the folders: each rank writes its own
shards, a manifest of sha256 written last, a killed save's temporary folder removed, --resume auto falls back
past a damaged shard and resumes bit-exactly, the folder resumes on one process (resharded), samples, and
exports to one file."""

import hashlib
import json
import pickle
import subprocess
import sys

import pytest
import torch
from test_train_cli import REPO, image_folder, run, train_args  # noqa: F401 (image_folder: a fixture)

from dit.checkpoint import list_checkpoints, load_checkpoint
from dit.io.errors import WRITER_KEY, UserError

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def fsdp(data, out, steps, *extra):
    done = run(
        [*TORCHRUN, *train_args(data, out, steps, "--fsdp", "--ckpt-every", "1", "--keep-last", "2", *extra)]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_fsdp_saves_sharded_folders_that_resume_exactly_verify_and_export(image_folder, tmp_path):  # noqa: F811
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    fsdp(image_folder, straight, 4)
    fsdp(image_folder, run_dir, 2, "--async-checkpoint")  # written in the background, sealed by the next save
    folder = run_dir / "checkpoints"
    assert [(s, p.is_dir()) for s, p in list_checkpoints(folder)] == [(1, True), (2, True)]
    manifest = json.loads((folder / "0000002" / "manifest.json").read_text())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "record.pt"} == set(
        manifest["files"]
    )  # each rank's shards
    # a flipped byte in rank 1's shard of the newest, and the temporary folder of a save killed at step 3
    shard = folder / "0000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    killed = folder / "0000003.tmp-dcp"
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"x" * 4096)
    resumed = fsdp(image_folder, run_dir, 4, "--resume", "auto")
    assert "0000002 fail their checksum" in resumed.stderr and "resuming from 0000001" in resumed.stderr
    assert not killed.exists() and "removed 1 partial checkpoint file(s)" in (run_dir / "log.txt").read_text()
    assert [s for s, _ in list_checkpoints(folder)] == [3, 4]  # keep_last 2 counted the folders
    a, b = (load_checkpoint(f / "checkpoints" / "0000004") for f in (straight, run_dir))  # one process, no group
    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert (
        a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
        and b["lineage"]["parent"]["file"] == "0000001"
    )
    # one process continues the two processes' folder (DCP reshards it), then one file for sampling
    alone = run(
        train_args(image_folder, tmp_path / "alone", 5, "--resume", str(straight / "checkpoints" / "0000004"))
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    out = tmp_path / "export.pt"
    export = [sys.executable, "-m", "dit.checkpoint", "export", str(folder / "0000004"), str(out)]
    assert subprocess.run(export, cwd=REPO, capture_output=True, text=True, timeout=120).returncode == 0
    assert out.with_name("export.pt.sha256").is_file() and load_checkpoint(out)["step"] == 4
    grid = [sys.executable, "sample.py", "--ckpt", str(out), "--num-sampling-steps", "2", "--class-labels", "0",
            "--out", str(tmp_path / "grid.png"), "--no-progress"]  # fmt: skip
    assert subprocess.run(grid, cwd=REPO, capture_output=True, text=True, timeout=120).returncode == 0


def test_a_sharded_folder_of_a_newer_format_or_foreign_metadata_is_one_line(tmp_path):
    from test_retention import sharded_save

    folder = tmp_path / "checkpoints"
    sharded_save(folder, 1, keep=0)
    path = folder / "0000001"
    assert load_checkpoint(path)["model"]["w"].tolist() == [1.0, 1.0]
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": "dit-ledger-dcp/2", WRITER_KEY: "9.0"}))
    with pytest.raises(UserError, match="format 2, written by dit-ledger 9.0.*upgrade"):
        load_checkpoint(path)
    # a .metadata that would run code when unpickled (its manifest rewritten to match): refused, not run
    (path / ".metadata").write_bytes(pickle.dumps(print))
    files = {**manifest["files"], ".metadata": hashlib.sha256((path / ".metadata").read_bytes()).hexdigest()}
    (path / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
    with pytest.raises(UserError, match="is not a checkpoint folder dit-ledger wrote"):
        load_checkpoint(path)


def test_the_export_face_refuses_missing_arguments_in_one_line(capsys, tmp_path):
    from dit.checkpoint.__main__ import main
    from dit.io.cli import run_cli

    for argv in ([], ["export"], ["export", str(tmp_path / "none"), str(tmp_path / "out.pt")]):
        assert run_cli(main, argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out.pt").exists()


@pytest.fixture
def disk(tmp_path):
    """A real small file system of the given size in KiB (a tmpfs; mounting one needs root): DCP's shard writes
    meet ENOSPC in every rank's process, as on a full cluster disk."""
    mounted = []

    def mount(kib: int):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(folder)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()[:80]})")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def full_disk_run(data, out, every: int, *extra):
    """A two-process run that saves every ``every`` steps, keeping all, until its disk is full: (its stderr, its
    one ``error:`` line, the checkpoints kept). One line from rank 0, exit 2 on both ranks, no rank's traceback."""
    args = train_args(data, out, 60, "--ckpt-every", str(every), "--keep-last", "0", "--no-progress", *extra)
    done = run([*TORCHRUN, *args])
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and len(errors) == 1, done.stderr[-3000:]
    assert "]: Traceback" not in done.stderr and done.stderr.count("exitcode  : 2 ") == 2, done.stderr[-3000:]
    folder = out / "checkpoints"
    assert not list(folder.glob("*.tmp-*"))  # the refused save's shards are gone
    kept = list_checkpoints(folder)
    assert (
        "No space left on device" in errors[0]
        and f"the newest checkpoint kept is {kept[-1][1].name} (" in errors[0]
    )
    return done.stderr, errors[0], kept


def test_a_sharded_save_on_a_full_disk_is_one_line_naming_the_folders_kept(image_folder, disk):  # noqa: F811
    """Issue 41 item 4: six rank tracebacks and no line; then "no checkpoint was kept" beside sealed folders (the
    check looked for *.pt alone). A checkpoint here is a 1.3 MB folder: room for three, and part of a fourth."""
    out = disk(4700) / "run"
    _, line, kept = full_disk_run(image_folder, out, 1, "--fsdp")
    assert len(kept) >= 3 and all(p.is_dir() for _, p in kept)
    assert f"cannot write {out / 'checkpoints' / f'{kept[-1][0] + 1:07d}'}:" in line
    assert all(load_checkpoint(p, mmap=True)["step"] == s for s, p in kept)  # each one whole


def test_a_ddp_save_on_a_full_disk_is_one_line_from_rank_0(image_folder, disk):  # noqa: F811
    """The one-file form on two processes: rank 1 waited for rank 0's file in a barrier and traced back (gloo's
    "Connection closed by peer") as rank 0 exited with its line. A checkpoint here is a 0.8 MB file."""
    out = disk(2500) / "run"
    _, line, kept = full_disk_run(image_folder, out, 1)
    assert kept and all(p.suffix == ".pt" for _, p in kept)
    assert f"cannot write {out / 'checkpoints' / f'{kept[-1][0] + 1:07d}.pt'}:" in line


def test_a_background_save_that_fails_stops_the_run_as_a_foreground_one(image_folder, disk):  # noqa: F811
    """--async-checkpoint: the failure showed at the next save as six rank tracebacks. Now it is the foreground's
    line and exit, with the folders sealed before it kept. How soon it shows depends on the writer thread's pace:
    the loop asks at every step (``test_a_background_save_is_asked_how_it_went_without_waiting_for_it``), so
    here, --log-every 1, at the first step after the write failed. Room for two 1.3 MB folders and half a third."""
    out = disk(3300) / "run"
    _, line, kept = full_disk_run(image_folder, out, 4, "--fsdp", "--async-checkpoint")
    failed = kept[-1][0] + 4
    assert [s for s, _ in kept] == [4, 8] and f"cannot write {out / 'checkpoints' / f'{failed:07d}'}:" in line
    logged = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert failed <= logged[-1] <= failed + 4, logged  # no step past the next save, where it showed before


def test_a_refused_write_names_the_newest_checkpoint_of_either_form(tmp_path, monkeypatch):
    """The line of any refused write of a run says which checkpoint is kept from the checkpoint package's own
    listing: sealed folders count (a glob of *.pt said "no checkpoint was kept" beside three), a save cut short
    does not. Here a one-process resume of an FSDP run's folder meets a full disk at its first log."""
    import errno
    import warnings

    from test_train import Pixels, tiny_config

    from dit.checkpoint import kept_checkpoints, remove_checkpoint, sharded
    from dit.train import train
    from dit.train.sinks import Metrics

    train(tiny_config(tmp_path, max_steps=2, ckpt_every=1, keep_last=0), Pixels())
    folder = tmp_path / "run" / "checkpoints"
    for step, path in list_checkpoints(folder):  # each file as the folder an FSDP run saves for its step
        payload = load_checkpoint(path)
        remove_checkpoint(path)
        tensors, record = sharded.split(payload)
        final = folder / f"{step:07d}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's "no process group: one process" note
            sharded.write(sharded.temp_folder(final), tensors)
        sharded.seal(sharded.temp_folder(final), final, step, record, {})
    (folder / "0000003.tmp-dcp").mkdir()  # and a save that a kill cut short
    said = f"the newest checkpoint kept is 0000002 (2 in {folder})"
    assert kept_checkpoints(folder) == said

    def full(self, record, step):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Metrics, "scalars", full)
    with pytest.raises(UserError, match="metrics.jsonl: No space left on device") as refused:
        train(tiny_config(tmp_path, max_steps=4, log_every=1, resume="auto"), Pixels())
    assert str(refused.value).endswith(f"; {said}.")
    assert kept_checkpoints(tmp_path / "none") == "no checkpoint was kept"


def test_a_background_save_is_asked_how_it_went_without_waiting_for_it(tmp_path):
    """The loop's check at every step looks at the writer's future on the host: one still writing is left to
    write (no wait), one that failed is the foreground's line at once, its temporary folder removed."""
    import errno
    import traceback
    from concurrent.futures import Future

    from torch.distributed.checkpoint.api import CheckpointException

    from dit.checkpoint import Checkpointer, CheckpointSection
    from dit.io.atomic import CannotWrite
    from dit.runtime import Runtime

    section = CheckpointSection(results_dir=str(tmp_path / "run"), async_checkpoint=True)
    checkpointer = Checkpointer(section, Runtime("cpu"))
    final = section.folder / "0000004"
    temp = final.with_name("0000004.tmp-dcp")
    temp.mkdir(parents=True)
    writing = Future()
    checkpointer.pending = (temp, final, 4, {}, writing)
    checkpointer.check(everyone=False)  # returns at once: the save is still being written
    assert checkpointer.pending is not None
    full = OSError(errno.ENOSPC, "No space left on device")
    writing.set_exception(CheckpointException("write", {1: (full, traceback.StackSummary())}))
    with pytest.raises(CannotWrite, match=f"cannot write {final}: No space left on device"):
        checkpointer.check(everyone=False)
    assert not temp.exists() and checkpointer.pending is None
