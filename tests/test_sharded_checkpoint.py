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
