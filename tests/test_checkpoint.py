"""Checkpoint files: atomic writes, safe loads, official formats."""

import argparse
import os

import pytest
import torch

from dit import checkpoint as ck
from dit.io.errors import UserError


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    first = ck.save_training_checkpoint(folder, 10, {"model": {"w": torch.ones(3)}})
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(UserError, match="disk full"):  # one line naming the file, not a traceback
        ck.save_training_checkpoint(folder, 20, {"model": {"w": torch.zeros(3)}})
    monkeypatch.setattr(torch, "save", real_save)
    assert ck.latest_checkpoint(folder) == first
    assert sorted(os.listdir(folder)) == ["0000010.pt", "0000010.pt.sha256"]  # no temp file left behind
    assert torch.equal(ck.load_checkpoint(first)["model"]["w"], torch.ones(3))


def test_keep_last_and_latest(tmp_path):
    for step in (1, 2, 3, 4):
        ck.save_training_checkpoint(tmp_path, step, {"model": {}}, keep_last=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 4]
    (tmp_path / ".0000005.pt.abc.tmp").write_bytes(b"junk")  # an interrupted write is never "latest"
    assert ck.latest_checkpoint(tmp_path).name == "0000004.pt"
    ck.save_training_checkpoint(tmp_path, 2, {"model": {}}, keep_last=2)  # resumed from an older file
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 3, 4]  # kept, and newer files are not its line


def test_official_train_checkpoint_loads_without_unpickling_code(tmp_path):
    path = tmp_path / "0050000.pt"
    args = argparse.Namespace(model="DiT-XL/2", image_size=256, num_classes=1000)
    torch.save({"model": {"w": torch.ones(1)}, "ema": {"w": torch.zeros(1)}, "opt": {}, "args": args}, path)
    ckpt = ck.load_checkpoint(path)
    assert ckpt["args"]["model"] == "DiT-XL/2"
    weights, which = ck.model_weights(ckpt)
    assert which == "ema" and torch.equal(weights["w"], torch.zeros(1))
    assert ck.model_weights(ckpt, use_ema=False)[1] == "model"


def test_bare_state_dict_and_hostile_pickles(tmp_path):
    bare = tmp_path / "DiT-XL-2-256x256.pt"
    torch.save({"pos_embed": torch.zeros(1, 4, 8)}, bare)
    assert ck.model_weights(ck.load_checkpoint(bare))[1] == "state_dict"

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo should-not-run",))

    evil = tmp_path / "evil.pt"
    torch.save({"x": Payload()}, evil)
    with pytest.raises(UserError, match="weights_only"):
        ck.load_checkpoint(evil)
    with pytest.raises(UserError, match="does not exist"):
        ck.load_checkpoint(tmp_path / "missing.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(bare.read_bytes()[:50])
    with pytest.raises(UserError, match="cannot read"):
        ck.load_checkpoint(truncated)


def test_resume_reads_only_our_format(tmp_path):
    ours = ck.save_training_checkpoint(tmp_path / "ours", 5, {"model": {}, "model_config": {"depth": 1}})
    assert ck.load_training_checkpoint(ours)["format"] == ck.FORMAT
    official = tmp_path / "official.pt"
    torch.save({"model": {}, "ema": {}, "opt": {}, "args": argparse.Namespace(model="DiT-XL/2")}, official)
    with pytest.raises(UserError, match="official DiT file"):
        ck.load_training_checkpoint(official)
    future = tmp_path / "future.pt"
    torch.save({"format": "dit-ledger/9", "model": {}, "model_config": {}}, future)
    with pytest.raises(UserError, match="format 9, written by a newer dit-ledger.*upgrade dit-ledger"):
        ck.load_training_checkpoint(future)
