"""The fault and bad-input matrix (docs/reliability.md): one test per case of issue 15, each a one-line
``error:`` (or the documented recovery), nothing lost."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_image_folder, run_face, write_our_checkpoint
from PIL import Image
from test_train import Pixels, tiny_config

from dit.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from dit.data.reader import LatentStoreDataset
from dit.data.store import MANIFEST, read_manifest, shard_file, verify_store, write_moments_store
from dit.io.atomic import FolderLock, atomic_write_bytes
from dit.io.cli import run_cli
from dit.io.config import flatten_record
from dit.io.errors import UserError
from dit.train import train

REPO = Path(__file__).resolve().parents[1]


def log(run: Path) -> str:
    return (run / "log.txt").read_text()


# ---- 1. one run per folder ----------------------------------------------------------------------------------


def test_1_a_run_folder_is_locked_and_a_dead_runs_lock_taken_over(tmp_path):
    cfg = tiny_config(tmp_path, max_steps=2)
    holder = FolderLock(cfg.checkpoint.results_dir, "training run", "wait").acquire()  # as a live run holds it
    with pytest.raises(UserError, match=rf"in use by another training run \(pid {os.getpid()}"):
        train(cfg, Pixels())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    holder.release()
    # a killed run leaves the file with its record but no flock: taken over, with a message
    (tmp_path / "run" / ".lock").write_text(json.dumps({"pid": 999999, "host": "gone", "since": "earlier"}))
    train(cfg, Pixels())
    assert "took over the lock of a run that is no longer running (pid 999999 on gone)" in log(tmp_path / "run")


# ---- 2. partial checkpoint files ----------------------------------------------------------------------------


def test_2_partial_checkpoints_are_removed(tmp_path):
    train(tiny_config(tmp_path, max_steps=2), Pixels())
    partial = tmp_path / "run" / "checkpoints" / "0000004.pt.tmp-killed"
    partial.write_bytes(b"x" * 4096)  # a save that a kill -9 cut short
    train(tiny_config(tmp_path, max_steps=4, resume="auto"), Pixels())
    assert not partial.exists() and [s for s, _ in list_checkpoints(partial.parent)] == [2, 4]
    assert "removed 1 partial checkpoint file(s)" in log(tmp_path / "run")


# ---- 3 and 4. a damaged latent store -------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path) -> Path:
    g = torch.Generator().manual_seed(0)
    moments = torch.randn(24, 2, 2, 4, 4, 4, generator=g).abs() * 0.1
    write_moments_store(str(tmp_path / "store"), moments, torch.arange(24) % 3, num_classes=3, shard_size=8)
    return tmp_path / "store"


def test_3_a_flipped_byte_in_a_shard_is_caught_on_first_use(store):
    shard = store / shard_file(1)
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x40  # a latent off by orders of magnitude, as in the report
    shard.write_bytes(bytes(data))
    ds = LatentStoreDataset(str(store))  # opening is cheap: no pass over the data
    ds[0]  # shard 0 is fine
    with pytest.raises(UserError, match=r"shard-00001\.safetensors fails its sha256 check.*extract_features\.py"):
        ds[8]


@pytest.mark.parametrize("byte", [0, 20])
def test_3_a_flipped_byte_in_a_shard_header_is_one_line(store, byte):
    shard = store / shard_file(1)
    data = bytearray(shard.read_bytes())
    data[byte] ^= 0x40  # the header's length, or its JSON: read when the store opens, before any checksum
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"shard-00001\.safetensors is damaged.*extract_features\.py"):
        LatentStoreDataset(str(store))


def test_4_a_manifest_stripped_of_its_checksum_is_refused(store):
    manifest = json.loads((store / MANIFEST).read_text())
    del manifest["manifest_sha256"]
    manifest["scaling_factor"] *= 1000  # without the checksum, this edit would pass
    (store / MANIFEST).write_text(json.dumps(manifest))
    for read in (LatentStoreDataset, verify_store):
        with pytest.raises(UserError, match="manifest_sha256 is missing"):
            read(str(store))


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda text: text[:-20], "not valid JSON"),
        (
            lambda text: text.replace('"scaling_factor": 0.18215', '"scaling_factor": 182.15'),
            "changed after it was written",
        ),
        (lambda text: text.replace('"num_images": 24', '"num_images": 25'), "changed after it was written"),
    ],
)
def test_4_a_damaged_manifest_is_refused_by_the_reader_and_verify(store, damage, match):
    path = store / MANIFEST
    path.write_text(damage(path.read_text()))
    for read in (LatentStoreDataset, verify_store):
        with pytest.raises(UserError, match=match):
            read(str(store))


def test_4_a_manifest_without_its_keys_names_them(store):
    manifest = json.loads((store / MANIFEST).read_text())
    for key in ("shards", "scaling_factor", "manifest_sha256"):
        manifest.pop(key)
    (store / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="scaling_factor is missing; shards is missing"):
        read_manifest(str(store))


# ---- 5. a resume that would change the run ------------------------------------------------------------------


def test_5_resume_refuses_other_settings_and_rewrites_nothing(tmp_path):
    train(tiny_config(tmp_path, max_steps=2), Pixels())
    latest = latest_checkpoint(tmp_path / "run" / "checkpoints")
    before = latest.read_bytes()
    with pytest.raises(UserError, match=r"seed: 0 -> 1; lr: 0.001 -> 0.0005"):
        train(tiny_config(tmp_path, max_steps=4, resume="auto", seed=1, lr=5e-4), Pixels())
    with pytest.raises(UserError, match="only recipe fields"):
        tiny_config(tmp_path, resume="auto", allow_changes=["seed"])
    assert latest.read_bytes() == before and latest_checkpoint(latest.parent) == latest
    train(tiny_config(tmp_path, max_steps=4, resume="auto", lr=5e-4, allow_changes=["lr"]), Pixels())
    assert load_checkpoint(latest_checkpoint(latest.parent))["step"] == 4


# ---- 6. numeric flags out of range ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [("class_dropout_prob", 1.0), ("class_dropout_prob", -0.1), ("max_nonfinite", 0), ("ema_decay", 1.0),
     ("min_lr_frac", 1.5), ("peak_tflops", 0.0), ("price_per_hour", -1.0), ("memory_reserve_gib", -2.0),
     ("eval_guidance_scale", 0.5), ("global_batch_size", 0), ("num_workers", -1)],
)  # fmt: skip
def test_6_out_of_range_flags_name_themselves(tmp_path, field, value):
    flag = "--" + field.replace("_", "-")
    with pytest.raises(UserError, match=flag):
        tiny_config(tmp_path, **{field: value})


# ---- 7. OS errors -------------------------------------------------------------------------------------------


def test_7_results_dir_that_is_a_file_or_unwritable(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        tiny_config(tmp_path, results_dir=str(tmp_path / "file"))
    real_open = os.open

    def read_only(path, *a, **k):
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(UserError, match=r"cannot write .*\.lock: Permission denied\. Make the folder writable"):
        train(tiny_config(tmp_path / "ro"), Pixels())


def test_7_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_last_one(tmp_path, monkeypatch):
    train(tiny_config(tmp_path, max_steps=2), Pixels())
    latest = latest_checkpoint(tmp_path / "run" / "checkpoints")

    def full(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UserError, match="No space left on device. Free space on that disk") as err:
        train(tiny_config(tmp_path, max_steps=4, resume="auto"), Pixels())
    assert "\n" not in str(err.value)
    assert latest_checkpoint(latest.parent) == latest and not list(latest.parent.glob("*.tmp-*"))


@pytest.fixture
def small_disk(tmp_path):
    """A real 400 KiB file system (a tmpfs; mounting one needs root): torch.save meets ENOSPC as the C++
    writer's `unexpected pos`, not as the OSError a mock raises."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()[:80]}); the mocked test covers it")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)  # lazily: a run may still hold its log


def test_7_a_real_full_disk_during_a_checkpoint_is_one_line(small_disk, capsys):
    images = make_image_folder(small_disk.parent / "images", {"a": 4, "b": 4})
    argv = ["--data-path", images, "--vae", "none", "--depth", "2", "--hidden-size", "32", "--num-heads", "2",
            "--image-size", "8", "--num-classes", "3", "--global-batch-size", "4", "--max-steps", "4",
            "--precision", "fp32", "--num-workers", "0", "--peak-tflops", "0.05", "--device", "cpu",
            "--results-dir", str(small_disk / "run")]  # fmt: skip
    code, _, err = run_face("train.py", argv, capsys)
    assert code == 2 and "Traceback" not in err and "unexpected pos" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "No space left on device" in line and "no checkpoint was kept" in line
    assert not list((small_disk / "run" / "checkpoints").iterdir())  # no partial file, no stray checksum


def fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` but ``leave`` bytes with one file (the disk's earlier contents removed)."""
    import shutil

    for p in disk.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    st = os.statvfs(disk)
    (disk / "filler").write_bytes(b"x" * max(0, st.f_bavail * st.f_frsize - leave))


def test_7_every_write_of_a_run_meets_a_full_disk_as_one_line(small_disk):
    """A sweep of how much room is left, so that each of a run's writes in turn is the one that fails: the
    lock, config.yaml, TensorBoard's event file, log.txt, metrics.jsonl, a checkpoint. Each is one line
    (TensorBoard's writer thread and the lock's pwrite were tracebacks), in a process of its own, as users run
    it (a thread's traceback prints as the process ends)."""
    import subprocess
    import sys

    images = make_image_folder(small_disk.parent / "images", {"a": 4, "b": 4})
    argv = ["--data-path", images, "--vae", "none", "--depth", "2", "--hidden-size", "32", "--num-heads", "2",
            "--image-size", "8", "--num-classes", "3", "--global-batch-size", "4", "--max-steps", "4",
            "--log-every", "1", "--precision", "fp32", "--num-workers", "0", "--peak-tflops", "0.05",
            "--device", "cpu", "--results-dir", str(small_disk / "run")]  # fmt: skip
    named = set()
    for leave in (0, 4096, 8192, 12288, 16384, 24576):
        fill(small_disk, leave)
        done = subprocess.run(
            [sys.executable, "train.py", *argv], cwd=REPO, capture_output=True, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
        assert done.returncode == 2 and "Traceback" not in done.stderr and len(errors) == 1, (leave, done.stderr)
        assert "No space left on device" in errors[0] and ("kept" in errors[0] or "nothing" in errors[0])
        named.add(errors[0].split("cannot write ", 1)[1].split(":", 1)[0].rsplit("/run", 1)[-1])
    assert len(named) >= 4, named  # the sweep reached several different writes


def test_7_sample_extraction_and_references_meet_a_full_disk_as_one_line(small_disk, our_ckpt, vae_dir, capsys):
    from dit.eval.__main__ import main as eval_main

    images = make_image_folder(small_disk.parent / "images", {"a": 3, "b": 3})
    digits = small_disk.parent / "digits.npz"
    np.savez(digits, np.random.default_rng(0).integers(0, 256, (80, 28, 28, 1), dtype=np.uint8))
    faces = {
        "sample.py": ("sample.py", ["--ckpt", str(our_ckpt), "--num-sampling-steps", "2", "--out",
                                    str(small_disk / "sample.png")]),
        "extract_features.py": ("extract_features.py", ["--data-path", images, "--feature-path",
                                str(small_disk / "store"), "--image-size", "32", "--vae", vae_dir,
                                "--num-workers", "0"]),
    }  # fmt: skip
    for name, (face_path, argv) in faces.items():
        fill(small_disk, 0)
        code, _, err = run_face(face_path, argv, capsys)
        errors = [x for x in err.splitlines() if x.startswith("error:")]
        assert code == 2 and len(errors) == 1 and "No space left on device" in errors[0], (name, err)
        assert "Traceback" not in err, (name, err)
    fill(small_disk, 0)
    code = run_cli(
        eval_main, ["ref", "--npz", str(digits), "--feature-net", "mnist", "--out", str(small_disk / "r.npz")]
    )
    err = capsys.readouterr().err
    assert code == 2 and "No space left on device" in err and "Traceback" not in err, err


def test_7_sample_out_that_is_a_folder_fails_before_sampling(our_ckpt, tmp_path, capsys):
    code, _, err = run_face("sample.py", ["--ckpt", str(our_ckpt), "--out", str(tmp_path)], capsys)
    assert code == 2 and err.startswith("error: --out") and "is a folder" in err


# ---- 8. images ----------------------------------------------------------------------------------------------


def test_8_a_bad_image_in_a_worker_is_one_line(tmp_path):
    images = make_image_folder(tmp_path / "images", {"cat": 5, "dog": 5})
    cfg = tiny_config(tmp_path, data_path=images, num_classes=3, image_size=8, num_workers=1, max_steps=8)
    with pytest.raises(UserError) as err:
        train(cfg)
    text = str(err.value)
    assert "broken.jpg" in text and "\n" not in text and "Traceback" not in text


def test_8_sixteen_bit_pngs_are_scaled_not_clipped(tmp_path):
    from dit.data.images import read_image

    wide = np.array([[0, 32768, 65535, 1000]], dtype=np.uint16).repeat(4, 0)
    Image.fromarray(wide).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode.startswith("I")
    x = read_image(str(tmp_path / "deep.png"), 4)
    assert x.shape == (3, 4, 4) and x[0, 0].tolist() == [0, 128, 255, 4]  # 65535 -> 255, not 0/255 only


def test_8_32_bit_integer_images_are_scaled_by_their_range(tmp_path):
    from dit.data.images import read_image

    deep = np.array([[0, 2**30, 2**31 - 1, 70000]], dtype=np.int32).repeat(4, 0)
    Image.fromarray(deep, mode="I").save(tmp_path / "deep.tif")
    assert Image.open(tmp_path / "deep.tif").mode == "I"
    x = read_image(str(tmp_path / "deep.tif"), 4)
    assert x[0, 0].tolist() == [0, 128, 255, 0]  # above 65535: 31 bits (they were clipped to 255)


def test_8_a_float_image_is_refused_in_one_line(tmp_path):
    """A 32-bit float TIFF decoded all black and counted as a good image."""
    from dit.data.images import read_image

    Image.fromarray(np.full((8, 8), 0.7, dtype=np.float32), mode="F").save(tmp_path / "float.tif")
    with pytest.raises(UserError, match="holds 32-bit floats, whose range .* convert it to 8 or 16 bits"):
        read_image(str(tmp_path / "float.tif"), 8)


# ---- 9. FID sample sets -------------------------------------------------------------------------------------


def fid(ckpt, out, n=4, *extra):
    argv = ["--ckpt", ckpt, "--sample-dir", out, "--num-fid-samples", n, "--per-proc-batch-size", 2,
            "--num-sampling-steps", 2, "--precision", "fp32", "--peak-tflops", 1, *extra]  # fmt: skip
    return [str(a) for a in argv]


def test_9_sample_sets_stale_temps_truncated_pngs_and_another_size(our_ckpt, tmp_path, capsys):
    code, _, err = run_face("scripts/sample_ddp.py", fid(our_ckpt, tmp_path), capsys)
    assert code == 0, err
    (npz,) = tmp_path.glob("*.npz")
    folder = npz.with_suffix("")
    good = (folder / "000001.png").read_bytes()
    (folder / "000001.png").write_bytes(good[: len(good) // 2])  # cut short
    (folder / "000002.png.tmp-dead").write_bytes(b"half")  # a write a kill interrupted
    npz.unlink()
    code, _, err = run_face("scripts/sample_ddp.py", fid(our_ckpt, tmp_path), capsys)
    assert code == 0, err
    assert (folder / "000001.png").read_bytes() == good and not list(folder.glob("*.tmp-*"))
    first = npz.read_bytes()
    code, _, err = run_face("scripts/sample_ddp.py", fid(our_ckpt, tmp_path, 6), capsys)
    assert code == 0, err
    assert npz.read_bytes() == first and len(list(tmp_path.glob("*.npz"))) == 2  # another set, not a replacement
    identity = json.loads((folder / "sample_set.json").read_text())
    assert len(identity["ckpt_sha256"]) == 64 and identity["num_fid_samples"] == 4


def test_9_other_weights_at_the_same_path_are_another_set(tmp_path, capsys, vae_dir):
    ckpt = write_our_checkpoint(tmp_path / "a", vae_dir, seed=0)
    assert run_face("scripts/sample_ddp.py", fid(ckpt, tmp_path / "s"), capsys)[0] == 0
    write_our_checkpoint(tmp_path / "a", vae_dir, seed=5)  # retrained, same file name
    code, _, err = run_face("scripts/sample_ddp.py", fid(ckpt, tmp_path / "s"), capsys)
    assert code == 2 and "other weights" in err


# ---- 10. how a run ends -------------------------------------------------------------------------------------


def test_10_a_run_that_fails_before_its_first_step_writes_no_checkpoint(tmp_path):
    class Broken(Pixels):
        def __getitem__(self, i):
            raise UserError(f"cannot decode image item{i}.png: broken. Remove or replace the file.")

    with pytest.raises(UserError, match="item"):
        train(tiny_config(tmp_path), Broken())
    assert latest_checkpoint(tmp_path / "run" / "checkpoints") is None
    train(tiny_config(tmp_path, max_steps=2), Pixels())  # so the rerun needs no --resume


def test_10_resume_is_logged(tmp_path):
    train(tiny_config(tmp_path, max_steps=2), Pixels())
    train(tiny_config(tmp_path, max_steps=3, resume="auto"), Pixels())
    assert "resumed from step 2 (" in log(tmp_path / "run")


# ---- 21. a rollback: a resume from an older checkpoint -----------------------------------------------------


def rollback_run(tmp_path, **kw):
    """Steps 1-8 on branch B, then a rollback to step 2 with another lr that stops at step 6."""
    train(tiny_config(tmp_path, max_steps=8, ckpt_every=2, keep_last=0), Pixels())
    folder = tmp_path / "run" / "checkpoints"
    old = {p.name: p.read_bytes() for _, p in list_checkpoints(folder)}
    again = tiny_config(tmp_path, max_steps=6, ckpt_every=2, keep_last=0, lr=5e-4, allow_changes=["lr"],
                        resume=str(folder / "0000002.pt"), **kw)  # fmt: skip
    train(again, Pixels())
    return folder, old


def test_21_resume_auto_follows_the_rollback_and_keeps_the_abandoned_branch(tmp_path):
    from dit.train import resolve

    folder, old = rollback_run(tmp_path)
    (kept,) = folder.glob("abandoned/*/0000008.pt")
    assert kept.read_bytes() == old["0000008.pt"] and str(kept.parent) in log(tmp_path / "run")
    assert (kept.parent / "0000004.pt").read_bytes() == old["0000004.pt"]  # not overwritten by the rollback's 4
    requeued = resolve(["--results-dir", str(tmp_path / "run"), "--resume", "auto", "--max-steps", "8"])
    assert requeued.optim.lr == 5e-4  # the rollback's record, not the abandoned branch's
    assert train(requeued, Pixels())["step"] == 8
    assert "resumed from step 6 (" in log(tmp_path / "run")
    newest = load_checkpoint(folder / "0000008.pt")
    branch = json.loads((folder / "branch.json").read_text())["branch"]
    assert newest["lineage"]["branch"] == branch != load_checkpoint(kept)["lineage"]["branch"]
    assert newest["lineage"]["parent"]["file"] == "0000006.pt"
    parent = load_checkpoint(folder / "0000004.pt")["lineage"]["parent"]  # the rollback's first checkpoint
    assert (parent["file"], parent["step"]) == ("0000002.pt", 2) and parent["branch"] != branch
    assert parent["sha256"] == (folder / "0000002.pt.sha256").read_text().split()[0]


def test_21_two_branches_without_a_record_of_the_last_are_one_line(tmp_path):
    from dit.train import resolve

    folder, _ = rollback_run(tmp_path)
    (kept,) = folder.glob("abandoned/*/0000008.pt")
    os.link(kept, folder / "0000008.pt")  # the abandoned branch's file back in the folder, as a copy would
    os.link(f"{kept}.sha256", folder / "0000008.pt.sha256")
    head = (folder / "branch.json").read_bytes()
    (folder / "branch.json").unlink()
    argv = ["--results-dir", str(tmp_path / "run"), "--resume", "auto", "--max-steps", "8"]
    with pytest.raises(UserError, match=r"2 branches .* 0000006\.pt, 0000008\.pt: pass --resume PATH"):
        resolve(argv)
    (folder / "branch.json").write_bytes(head)  # with the record, auto follows the rollback
    assert train(resolve(argv), Pixels())["step"] == 8
    assert "resumed from step 6 (" in log(tmp_path / "run")
    again = sorted(p.parent.name for p in folder.glob("abandoned/*/0000008.pt"))
    assert again == [kept.parent.name, f"{kept.parent.name}.2"]  # kept aside again, beside the first


def test_21_keep_last_counts_only_the_branch_followed(tmp_path):
    train(tiny_config(tmp_path, max_steps=8, ckpt_every=2, keep_last=2), Pixels())
    folder = tmp_path / "run" / "checkpoints"
    old8 = (folder / "0000008.pt").read_bytes()
    again = tiny_config(tmp_path, max_steps=9, ckpt_every=1, keep_last=2, lr=5e-4, allow_changes=["lr"],
                        resume=str(folder / "0000006.pt"))  # fmt: skip
    train(again, Pixels())
    assert [s for s, _ in list_checkpoints(folder)] == [8, 9]
    assert load_checkpoint(folder / "0000008.pt")["lineage"]["parent"]["file"] == "0000006.pt"  # the rollback's
    (kept,) = folder.glob("abandoned/*/0000008.pt")
    assert kept.read_bytes() == old8


# ---- 22. a data set that lost items since the checkpoint ----------------------------------------------------


def test_22_removing_the_bad_image_the_error_names_lets_the_run_continue(tmp_path):
    """The bad image's error says to remove the file; the run then resumes on the smaller set, with a note."""
    images = make_image_folder(tmp_path / "images", {"a": 12, "b": 12})  # 24 images and broken.jpg
    cfg = tiny_config(tmp_path, data_path=images, num_classes=3, max_steps=8)
    with pytest.raises(UserError, match=r"broken\.jpg.*Remove or replace the file"):
        train(cfg)
    folder = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in list_checkpoints(folder)] == [1]  # the work before the bad batch (seed 0)
    os.remove(Path(images) / "a" / "broken.jpg")
    assert train(cfg.replace(resume="auto"))["step"] == 8
    assert "the data set has 24 items, 1 fewer than the 25 of" in log(tmp_path / "run")
    assert "continuing at step 1 in the order of 24 items" in log(tmp_path / "run")
    position = load_checkpoint(latest_checkpoint(folder))["data_position"]
    assert position["dataset_len"] == 24 and position["changes"] == [{"step": 1, "dataset_len": 24, "was": 25}]
    Image.new("RGB", (32, 32)).save(Path(images) / "b" / "new.png")  # an added image is another data set
    before = latest_checkpoint(folder).read_bytes()
    with pytest.raises(UserError, match="trained on a data set of 24 items, this one has 25: added items"):
        train(cfg.replace(resume="auto", max_steps=10))
    assert latest_checkpoint(folder).read_bytes() == before


# ---- 11. file modes -----------------------------------------------------------------------------------------


def test_1_a_file_system_without_locks_is_one_line(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(UserError, match="cannot lock .*no file locks"):
        FolderLock(tmp_path / "run", "training run", "wait").acquire()


def test_11_atomic_writes_respect_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "shared.bin", b"x")
    finally:
        os.umask(old)
    assert (tmp_path / "shared.bin").stat().st_mode & 0o777 == 0o644


# ---- 12. a store's VAE ---------------------------------------------------------------------------------------


def test_12_a_store_run_records_the_stores_vae_and_decodes_its_grids(tmp_path, vae_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dit.extract import ExtractConfig, extract_features

    images = make_image_folder(tmp_path / "images", {"a": 4, "b": 4})
    store = tmp_path / "store"
    extract_features(
        ExtractConfig(feature_path=str(store), data_path=images, image_size=32, vae=vae_dir, num_workers=0)
    )
    cfg = tiny_config(tmp_path, feature_path=str(store), vae="ema", image_size=32, num_classes=3, max_steps=2,
                      global_batch_size=4, sample_every=2)  # fmt: skip
    train(cfg)
    saved = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert flatten_record(saved["config"])["vae"] == os.path.abspath(vae_dir)  # not the --vae default
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    (grid,) = events.Images("samples/ema")
    assert grid.width > 32 and grid.height >= 32  # decoded 32 px images, not 4x4 latents


# ---- 13. the seeding the docs describe -----------------------------------------------------------------------


def test_13_image_i_is_keyed_by_its_position_in_the_list(our_ckpt, tmp_path, capsys):
    """docs/sampling.md: image i's noise is keyed by (seed, i), i its position in --class-labels."""
    common = ["--ckpt", str(our_ckpt), "--num-sampling-steps", "4", "--precision", "fp32", "--peak-tflops", "1",
              "--nrow", "1"]  # fmt: skip
    run_face("sample.py", [*common, "--class-labels", "1", "2", "--out", str(tmp_path / "both.png")], capsys)
    run_face("sample.py", [*common, "--class-labels", "1", "--out", str(tmp_path / "first.png")], capsys)
    run_face("sample.py", [*common, "--class-labels", "2", "--out", str(tmp_path / "second.png")], capsys)
    both, first, second = (np.asarray(Image.open(tmp_path / f"{n}.png")) for n in ("both", "first", "second"))
    size = first.shape[0]  # a lone image is saved without the grid's 2-pixel padding
    top, bottom = (both[2 + k * (size + 2) : 2 + k * (size + 2) + size, 2 : 2 + size].astype(int) for k in (0, 1))
    assert np.abs(top - first).max() <= 1  # position 0 alone = position 0 in the list (to a rounding step)
    assert np.abs(bottom - second).mean() > 5  # label 2 alone is drawn from position 0's noise, not position 1's
