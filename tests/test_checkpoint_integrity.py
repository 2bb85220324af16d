"""Checkpoint integrity (docs/reliability.md, issue 26 item 2): every checkpoint carries the sha256 of its
bytes beside it; a changed, truncated or empty file is never resumed from or sampled silently."""

from __future__ import annotations

import hashlib

import pytest
from helpers import make_image_folder, run_face
from test_train import Pixels, tiny_config

from dit.checkpoint import (
    atomic_torch_save,
    checksum_path,
    list_checkpoints,
    load_checkpoint,
    verify_checkpoint,
)
from dit.io.errors import UserError
from dit.train import resolve, train


def a_run(tmp_path, steps=4, **kw):
    cfg = tiny_config(tmp_path, max_steps=steps, ckpt_every=2, log_every=1, **kw)
    train(cfg, Pixels())
    return tmp_path / "run" / "checkpoints"


def flip_a_byte(path, offset_from_end=4096):
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_checkpoint_carries_the_sha256_of_its_bytes(tmp_path):
    folder = a_run(tmp_path)
    for _, path in list_checkpoints(folder):
        digest, name = checksum_path(path).read_text().split()
        assert name == path.name and digest == hashlib.sha256(path.read_bytes()).hexdigest()
        assert verify_checkpoint(path) is True
    flip_a_byte(path)
    assert verify_checkpoint(path) is False


def test_resume_auto_falls_back_to_the_newest_file_that_verifies(tmp_path, capsys):
    folder = a_run(tmp_path)
    newest = folder / "0000004.pt"
    flip_a_byte(newest)
    cfg = resolve(["--results-dir", str(tmp_path / "run"), "--resume", "auto", "--max-steps", "6"])
    assert "0000004.pt fail their checksum" in capsys.readouterr().err
    result = train(cfg, Pixels())
    assert result["step"] == 6
    assert "resumed from step 2" in (tmp_path / "run" / "log.txt").read_text()


def test_no_checkpoint_that_verifies_is_one_line(tmp_path):
    folder = a_run(tmp_path, steps=2)
    (folder / "0000002.pt").write_bytes((folder / "0000002.pt").read_bytes()[:-1000])  # truncated
    with pytest.raises(UserError, match="no checkpoint in .* matches its checksum"):
        resolve(["--results-dir", str(tmp_path / "run"), "--resume", "auto"])


@pytest.mark.parametrize("damage", ["empty", "flipped", "truncated"])
def test_a_damaged_file_given_to_a_face_is_one_line(tmp_path, capsys, damage):
    folder = a_run(tmp_path, steps=2)
    path = folder / "0000002.pt"
    images = make_image_folder(tmp_path / "images")
    if damage == "empty":
        path.write_bytes(b"")
        checksum_path(path).unlink()  # an empty file with no checksum beside it
    elif damage == "flipped":
        flip_a_byte(path)
    else:
        path.write_bytes(path.read_bytes()[:5000])
        checksum_path(path).unlink()  # torch's own error, without the checksum's help
    for face, argv in [
        ("sample.py", ["--ckpt", str(path), "--num-sampling-steps", "2", "--out", str(tmp_path / "s.png")]),
        (
            "train.py",
            [
                "--results-dir",
                str(tmp_path / "other"),
                "--init-from",
                str(path),
                "--max-steps",
                "1",
                "--data-path",
                images,
                "--vae",
                "none",
                "--image-size",
                "8",
            ],
        ),  # fmt: skip
        ("train.py", ["--results-dir", str(tmp_path / "run"), "--resume", str(path)]),
    ]:
        code, _, err = run_face(face, argv, capsys)
        assert code != 0 and "Traceback" not in err, (face, err)
        line = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(line) == 1 and str(path) in line[0], (face, err)
        assert line[0].rstrip().endswith("."), line  # a whole sentence, not one cut in the middle


def test_keep_last_removes_checksums_with_their_checkpoints(tmp_path):
    folder = a_run(tmp_path, steps=6, keep_last=2)
    assert sorted(p.name for p in folder.iterdir()) == [
        "0000004.pt", "0000004.pt.sha256", "0000006.pt", "0000006.pt.sha256"
    ]  # fmt: skip


def test_a_loss_that_is_non_finite_from_the_resume_on_names_the_checkpoint(tmp_path):
    """The weights resumed from are the suspect: a 6e31 weight (a flipped exponent saved with a matching
    checksum) made every step non-finite and the error blamed the learning rate."""
    folder = a_run(tmp_path, steps=2)
    path = folder / "0000002.pt"
    ckpt = load_checkpoint(path)
    name = next(k for k in ckpt["model"] if k.endswith("attn.qkv.weight"))
    for kind in ("model", "ema"):
        ckpt[kind][name][0, 0] = 6e31
    atomic_torch_save(ckpt, path)
    cfg = resolve(["--results-dir", str(tmp_path / "run"), "--resume", "auto", "--max-steps", "40",
                              "--max-nonfinite", "2"])  # fmt: skip
    with pytest.raises(UserError, match="steps after resuming from .*0000002.pt: that checkpoint is the suspect"):
        train(cfg, Pixels())
