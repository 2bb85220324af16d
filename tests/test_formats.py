"""Files from other versions (issue 31, item 4): every reader of a versioned file we write refuses a newer
format in one line naming the dit-ledger that wrote it and saying to upgrade, and reads the older ones."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_image_folder, run_face, write_our_checkpoint

from dit import __version__
from dit.checkpoint import FORMAT, atomic_torch_save, load_checkpoint, load_training_checkpoint
from dit.checkpoint.lineage import HEAD, HEAD_FORMAT, follow, read_head
from dit.data.reader import LatentStoreDataset
from dit.data.store import FORMAT_VERSION, MANIFEST, check_existing_store, write_manifest, write_moments_store
from dit.eval.reference import FORMAT as STATS_FORMAT
from dit.eval.reference import checksum, load_reference, save_stats
from dit.io.errors import WRITER_KEY, UserError, refuse_newer_format
from dit.sample.loading import load_sampling_model
from dit.train import resolve

DATA = Path(__file__).parent / "data"
LATER = "9.9.0"  # the dit-ledger a newer file names as its writer


def later(tag: str) -> str:
    """The format tag after ``tag`` (``name/N`` -> ``name/N+1``)."""
    name, _, n = tag.rpartition("/")
    return f"{name}/{int(n) + 1}"


def the_error(err: str, path, number: int, writer: str | None = LATER) -> str:
    """The one error line, checked: the file, its format number, the version that wrote it, the upgrade."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    (line,) = lines
    assert str(path) in line and f"format {number}," in line and "upgrade dit-ledger" in line, line
    assert f"written by dit-ledger {writer};" in line if writer else "written by a newer dit-ledger;" in line, line
    assert f"this dit-ledger ({__version__})" in line, line
    return line


def test_the_check_compares_numbers_and_tags_of_one_name():
    refuse_newer_format("f", "thing", 1, 1)
    refuse_newer_format("f", "thing", "dit-ledger/1", "dit-ledger/1")
    refuse_newer_format("f", "thing", "dit-ledger/0", "dit-ledger/1")  # older: the reader decides
    refuse_newer_format("f", "thing", "other/7", "dit-ledger/1")  # another format: the reader says what it is
    refuse_newer_format("f", "thing", None, 1)
    refuse_newer_format("f", "thing", True, 1)
    with pytest.raises(UserError) as e:
        refuse_newer_format("f", "thing", "dit-ledger/12", "dit-ledger/1", "3.0")
    the_error(f"error: {e.value}", "f", 12, "3.0")
    with pytest.raises(UserError) as e:
        refuse_newer_format("f", "thing", 2, 1)
    the_error(f"error: {e.value}", "f", 2, None)


# ---- checkpoints: sample.py --ckpt, train.py --resume (a path, auto), train.py --init-from ------------------


def newer_checkpoint(path: Path, writer: str | None = LATER) -> Path:
    ckpt = torch.load(path, weights_only=True)
    ckpt["format"] = later(FORMAT)
    if writer:
        ckpt[WRITER_KEY] = writer
    else:
        del ckpt[WRITER_KEY]
    atomic_torch_save(ckpt, path)  # its checksum too: the file is whole, only newer
    return path


@pytest.fixture
def checkpoints(tmp_path):
    """(ours, the same as a newer dit-ledger would write it) in two run folders."""
    ours = write_our_checkpoint(tmp_path / "run" / "checkpoints", None, in_channels=3)
    newer = write_our_checkpoint(tmp_path / "newer" / "checkpoints", None, in_channels=3)
    return ours, newer_checkpoint(newer)


def test_our_checkpoints_record_the_version_that_wrote_them(checkpoints):
    ours, _ = checkpoints
    ckpt = load_training_checkpoint(ours)
    assert (ckpt["format"], ckpt[WRITER_KEY]) == (FORMAT, __version__)
    load_sampling_model(ours)  # and they read


def test_sample_py_refuses_a_newer_checkpoint(checkpoints, capsys, tmp_path, monkeypatch):
    _, newer = checkpoints
    monkeypatch.chdir(tmp_path)
    code, _, err = run_face("sample.py", ["--ckpt", str(newer)], capsys)
    assert code == 2
    the_error(err, newer, int(later(FORMAT).rpartition("/")[2]))
    assert not (tmp_path / "sample.png").exists()


@pytest.mark.parametrize("how", ["path", "auto"])
def test_train_py_resume_refuses_a_newer_checkpoint(checkpoints, capsys, how):
    _, newer = checkpoints
    run = newer.parent.parent
    argv = ["--results-dir", str(run), "--resume", str(newer) if how == "path" else "auto", "--max-steps", "200"]
    code, _, err = run_face("train.py", argv, capsys)
    assert code == 2
    line = the_error(err, newer, int(later(FORMAT).rpartition("/")[2]))
    assert "--init-from" not in line  # it is ours, only newer: fine-tuning from it is not the fix
    assert sorted(p.name for p in newer.parent.iterdir()) == ["0000100.pt", "0000100.pt.sha256"]


def test_train_py_init_from_refuses_a_newer_checkpoint(checkpoints, capsys, tmp_path):
    newer = newer_checkpoint(checkpoints[1], writer=None)  # no writer recorded: "a newer dit-ledger"
    images = make_image_folder(tmp_path / "images", {"a": 2, "b": 2})
    argv = ["--data-path", images, "--vae", "none", "--depth", "1", "--hidden-size", "16", "--num-heads", "2",
            "--image-size", "8", "--num-classes", "3", "--global-batch-size", "2", "--max-steps", "1",
            "--precision", "fp32", "--num-workers", "0", "--device", "cpu", "--init-from", str(newer),
            "--results-dir", str(tmp_path / "tuned")]  # fmt: skip
    code, _, err = run_face("train.py", argv, capsys)
    assert code == 2
    the_error(err, newer, int(later(FORMAT).rpartition("/")[2]), writer=None)


def test_older_checkpoints_still_read(tmp_path, checkpoints):
    ours, _ = checkpoints
    ckpt = torch.load(ours, weights_only=True)
    del ckpt[WRITER_KEY]  # as every dit-ledger before this one wrote them
    atomic_torch_save(ckpt, ours)
    assert load_checkpoint(ours)["format"] == FORMAT
    load_sampling_model(ours)
    run = tmp_path / "v1"  # the flat run record of before the sections, and no writer
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "0000001.pt").write_bytes((DATA / "checkpoint_v1" / "0000001.pt").read_bytes())
    cfg = resolve(["--results-dir", str(run), "--resume", "auto", "--max-steps", "2"])
    assert (cfg.model.hidden_size, cfg.optim.lr) == (16, 1e-3)


# ---- latent stores: train.py --feature-path, extract_features.py --verify and its resume, the reader --------


@pytest.fixture
def store(tmp_path):
    moments = torch.randn(6, 1, 2, 4, 2, 2)
    write_moments_store(str(tmp_path / "store"), moments, torch.arange(6) % 2, num_classes=2, shard_size=4)
    return tmp_path / "store"


def rewrite_manifest(store: Path, **changes) -> dict:
    manifest = json.loads((store / MANIFEST).read_text())
    manifest = {k: v for k, v in {**manifest, **changes}.items() if v is not None and k != "manifest_sha256"}
    write_manifest(str(store), manifest)  # with its checksum: whole, only newer
    return manifest


def test_a_newer_store_is_refused_by_every_reader(store, capsys, tmp_path):
    spec_before = json.loads((store / MANIFEST).read_text())
    assert (spec_before["version"], spec_before[WRITER_KEY]) == (FORMAT_VERSION, __version__)
    rewrite_manifest(store, version=FORMAT_VERSION + 1, **{WRITER_KEY: LATER})
    manifest = store / MANIFEST
    argv = ["--feature-path", str(store), "--depth", "1", "--hidden-size", "16", "--num-heads", "2",
            "--max-steps", "1", "--device", "cpu", "--results-dir", str(tmp_path / "run")]  # fmt: skip
    code, _, err = run_face("train.py", argv, capsys)
    assert code == 2
    the_error(err, manifest, FORMAT_VERSION + 1)
    code, _, err = run_face("extract_features.py", ["--feature-path", str(store), "--verify"], capsys)
    assert code == 2
    the_error(err, manifest, FORMAT_VERSION + 1)
    for read in (LatentStoreDataset, lambda folder: check_existing_store(folder, None)):  # the reader; a resume
        with pytest.raises(UserError) as e:
            read(str(store))
        the_error(f"error: {e.value}", manifest, FORMAT_VERSION + 1)


def test_an_older_store_still_reads(store):
    rewrite_manifest(store, **{WRITER_KEY: None})  # as every dit-ledger before this one wrote it
    assert len(LatentStoreDataset(str(store))) == 6


# ---- reference statistics: python -m dit.eval --ref, the reader ---------------------------------------------


def write_stats(path: Path, fmt: str, writer: str | None) -> Path:
    """Statistics as ``save_stats`` writes them, with another format tag and writer."""
    rng = np.random.default_rng(0)
    arrays = {"mu": rng.normal(size=3), "sigma": np.eye(3)}
    meta = {
        "format": fmt,
        "feature_network": "digits",
        "num_images": 10,
        "source": "test",
        "sha256": checksum(arrays),
    }
    if writer:
        meta[WRITER_KEY] = writer
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


def test_a_newer_reference_is_refused(tmp_path, capsys):
    ref = write_stats(tmp_path / "ref.npz", later(STATS_FORMAT), LATER)
    code, _, err = run_face(
        "dit/eval/__main__.py", ["--samples", str(tmp_path / "s.npz"), "--ref", str(ref)], capsys
    )
    assert code == 2
    number = int(later(STATS_FORMAT).rpartition("/")[2])
    the_error(err, ref, number)
    renamed = write_stats(tmp_path / "renamed.npz", later(STATS_FORMAT), None)
    renamed_meta = json.loads(str(np.load(renamed)["meta"]))
    del renamed_meta["feature_network"]  # a newer format may name its keys otherwise: still the same line
    arrays = {"mu": np.load(renamed)["mu"], "sigma": np.load(renamed)["sigma"]}
    np.savez(renamed, meta=np.array(json.dumps(renamed_meta)), **arrays)
    with pytest.raises(UserError) as e:
        load_reference(str(renamed))
    the_error(f"error: {e.value}", renamed, number, writer=None)


def test_older_references_still_read(tmp_path):
    before = load_reference(str(write_stats(tmp_path / "old.npz", STATS_FORMAT, None)))  # no writer recorded
    assert before.feature_network == "digits"
    save_stats(str(tmp_path / "now.npz"), before)
    meta = json.loads(str(np.load(tmp_path / "now.npz")["meta"]))
    assert (meta["format"], meta[WRITER_KEY]) == (STATS_FORMAT, __version__)
    assert np.array_equal(load_reference(str(tmp_path / "now.npz")).mu, before.mu)


# ---- branch.json: train.py --resume auto ------------------------------------------------------------------


def test_a_newer_branch_record_is_refused_and_an_older_one_read(checkpoints, capsys):
    ours, _ = checkpoints
    folder = ours.parent
    record = {"branch": "abcd0123", "forks": {}, "parent": None}
    (folder / HEAD).write_text(json.dumps(record))  # as written before branch.json had a format
    assert read_head(folder)["branch"] == "abcd0123"
    (folder / HEAD).write_text(json.dumps({"format": later(HEAD_FORMAT), WRITER_KEY: LATER, **record}))
    with pytest.raises(UserError) as e:
        follow(folder)
    number = int(later(HEAD_FORMAT).rpartition("/")[2])
    the_error(f"error: {e.value}", folder / HEAD, number)
    code, _, err = run_face("train.py", ["--results-dir", str(folder.parent), "--resume", "auto"], capsys)
    assert code == 2
    the_error(err, folder / HEAD, number)


def test_a_newer_checkpoint_beside_older_ones_stops_resume_auto_before_its_lineage_is_read(checkpoints, capsys):
    """A newer dit-ledger continued the run and laid its lineage out otherwise: the folder is refused in the
    same line, not read as if it were ours."""
    ours, _ = checkpoints
    ckpt = torch.load(ours, weights_only=True)
    ckpt.update(step=200, format=later(FORMAT), lineage={"id": "a newer layout"}, **{WRITER_KEY: LATER})
    newer = atomic_torch_save(ckpt, ours.parent / "0000200.pt")
    code, _, err = run_face("train.py", ["--results-dir", str(ours.parent.parent), "--resume", "auto"], capsys)
    assert code == 2
    the_error(err, newer, int(later(FORMAT).rpartition("/")[2]))
