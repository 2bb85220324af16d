"""Issue 41's sweep of the writers on a full disk: each refused write is one line that says what is kept, and a
rerun continues from it. The run's writers (checkpoints of both forms, the sinks) are in test_faults.py and
test_sharded_checkpoint.py; here the sample sets, the latent store and a checkpoint's checksum."""

from __future__ import annotations

import errno

import pytest
import torch
from helpers import make_image_folder, run_face
from test_extract_features import args as store_args
from test_sample_ddp import N, fid_args
from test_sharded_checkpoint import disk  # noqa: F401 (a fixture)

import dit.data.store
import dit.sample.fid_set
from dit.data.store import shard_file
from dit.io.atomic import atomic_write
from dit.io.errors import UserError


def refuse(path, *_) -> None:
    """What the OS does to a write on a full disk, through the writer every file goes through."""

    def full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    atomic_write(path, full)


def one_line(err: str) -> str:
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "Traceback" not in err and "No space left on device. Free space on that disk" in line
    return line


def test_a_sample_set_on_a_full_disk_keeps_its_complete_samples_and_a_rerun_continues(
    our_ckpt, tmp_path, monkeypatch, capsys
):  # noqa: F811
    written = dit.sample.fid_set.write_png

    def png(path, image):
        (refuse if path.name == f"{3:06d}.png" else written)(path, image)

    monkeypatch.setattr(dit.sample.fid_set, "write_png", png)
    code, _, err = run_face("scripts/sample_ddp.py", fid_args(our_ckpt, tmp_path), capsys)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert code == 2 and one_line(err).endswith(
        f"; every complete sample in {folder} is kept and the same command continues from them."
    )
    assert sorted(p.name for p in folder.glob("*.png")) == [f"{i:06d}.png" for i in range(3)]
    monkeypatch.setattr(dit.sample.fid_set, "write_png", written)
    code, out, err = run_face("scripts/sample_ddp.py", fid_args(our_ckpt, tmp_path), capsys)
    assert code == 0 and f"{N - 2} images in" in out, err  # the batch cut short, and the ones after it


def test_a_latent_store_on_a_full_disk_keeps_its_complete_shards_and_a_rerun_continues(
    vae_dir, tmp_path, monkeypatch, capsys
):
    images = make_image_folder(tmp_path / "images", {"a_cat": 5, "b_dog": 4})
    written, out = dit.data.store.atomic_write_bytes, tmp_path / "store"

    def shard(path, data):
        return (refuse if str(path).endswith(shard_file(2)) else written)(path, data)

    monkeypatch.setattr(dit.data.store, "atomic_write_bytes", shard)
    code, _, err = run_face("extract_features.py", store_args(images, out, vae_dir), capsys)
    assert code == 2 and one_line(err).endswith(
        f"; every complete shard in {out} is kept and the same command continues from them."
    )
    assert (out / shard_file(1)).is_file() and not (out / shard_file(2)).exists()
    monkeypatch.setattr(dit.data.store, "atomic_write_bytes", written)
    code, _, err = run_face("extract_features.py", store_args(images, out, vae_dir), capsys)
    assert code == 0, err


def test_a_checkpoint_whose_checksum_is_refused_is_not_kept(tmp_path, monkeypatch):
    """A file without its .sha256 would be listed as kept (and loaded unverified): the save leaves neither."""
    from dit.checkpoint import atomic_torch_save, list_checkpoints

    written = dit.checkpoint.format.atomic_write_bytes
    monkeypatch.setattr(dit.checkpoint.format, "atomic_write_bytes", refuse)
    with pytest.raises(UserError, match=r"0000002\.pt\.sha256: No space left on device"):
        atomic_torch_save({"model": {"w": torch.ones(2)}}, tmp_path / "0000002.pt")
    assert list_checkpoints(tmp_path) == [] and not list(tmp_path.iterdir())
    monkeypatch.setattr(dit.checkpoint.format, "atomic_write_bytes", written)


def test_a_diffusers_export_on_a_full_disk_is_one_line_and_leaves_nothing(our_ckpt, disk, capsys):  # noqa: F811
    """save_pretrained's safetensors writer reports a full disk as its own exception: it was a traceback."""
    out = disk(200) / "pipe"
    code, _, err = run_face("scripts/export_diffusers.py", ["--ckpt", str(our_ckpt), "--out", str(out)], capsys)
    assert code == 2 and one_line(err).endswith(f"cannot write {out}: No space left on device. Free space on that "
                                                "disk or write elsewhere; nothing partial was left there.")  # fmt: skip
    assert not list(out.parent.iterdir())
