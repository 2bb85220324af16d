"""extract_features.py end to end: a tiny random VAE loaded from a folder, a synthetic image folder with a
corrupt image, a non-image file and an empty class; 1 vs 2 ranks, kill and resume, verify, bad input."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_vae, make_image_folder

from dit.data.images import read_image, to_model_range
from dit.data.reader import LatentStoreDataset
from dit.data.store import MANIFEST, read_header, sha256_file, shard_file
from dit.data.vae import encode_moments, load_vae
from dit.io.cli import run_cli
from dit.io.errors import UserError

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("extract_features", REPO / "extract_features.py")
extract_features = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(extract_features)

COUNTS = {"a_cat": 5, "b_dog": 4}  # + a_cat/broken.jpg: 10 sources, 9 images, 4 shards of 3 sources
SETTINGS = ["--image-size", "32", "--shard-size", "3", "--batch-size", "2", "--num-workers", "0"]


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vae")
    build_tiny_vae(seed=0).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("images"), COUNTS)


def args(data, out, vae, *extra):
    return ["--data-path", str(data), "--features-path", str(out), "--vae", str(vae), *SETTINGS, *extra]


def extract(*argv):
    return run_cli(extract_features.main, list(argv))


def files(folder):
    return {name: Path(folder, name).read_bytes() for name in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, images, vae_dir):
    """One uninterrupted single-process extraction that the other tests compare against."""
    out = tmp_path_factory.mktemp("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert extract(*args(images, out, vae_dir)) == 0
    torch.set_num_threads(threads)
    return str(out)


def test_store_contents_manifest_and_reader(reference, images, vae_dir):
    manifest = json.loads(Path(reference, MANIFEST).read_text())
    assert manifest["complete"] and manifest["num_images"] == 9 and manifest["num_sources"] == 10
    assert manifest["class_to_index"] == {"a_cat": 0, "b_dog": 1, "c_empty": 2}
    assert manifest["image_size"] == 32 and manifest["latent_shape"] == [4, 4, 4] and manifest["flips_stored"]
    assert manifest["scaling_factor"] == 0.18215 and manifest["storage_dtype"] == "fp16"
    assert manifest["crop"] == "adm_center_crop" and manifest["vae_id"] == os.path.abspath(vae_dir)
    reasons = {s["path"]: s["reason"] for s in manifest["skipped"]}
    assert manifest["num_skipped"] == 3 and reasons.keys() == {"a_cat/broken.jpg", "a_cat/notes.txt", "c_empty"}
    assert reasons["a_cat/broken.jpg"].startswith("corrupt image") and reasons["c_empty"] == "empty class folder"
    assert [s["num_images"] for s in manifest["shards"]] == [2, 3, 3, 1]  # shard 0 lost broken.jpg
    for shard in manifest["shards"]:
        assert sha256_file(os.path.join(reference, shard["file"])) == shard["sha256"]

    # Shard 0's first image is a_cat/img0.png: view 0 holds its moments, view 1 those of its mirror image.
    header, _ = read_header(os.path.join(reference, shard_file(0)))
    assert json.loads(header["__metadata__"]["dit_ledger"])["files"] == ["a_cat/img0.png", "a_cat/img1.png"]
    x = to_model_range(read_image(os.path.join(images, "a_cat", "img0.png"), 32))[None]
    vae = load_vae(vae_dir)
    store = LatentStoreDataset(reference, flip=False, sample_posterior=False)
    torch.testing.assert_close(store[0][0], encode_moments(vae, x)[0][0] * 0.18215, atol=2e-3, rtol=2e-3)
    store.flip = True
    torch.manual_seed(0)
    seen = {round(float(z[0, 0, 0]), 4) for z, _ in store.__getitems__([0] * 64)}
    mirrored = encode_moments(vae, x.flip(-1))[0][0, 0, 0, 0] * 0.18215
    assert len(seen) == 2 and min(abs(v - float(mirrored)) for v in seen) < 2e-3
    assert len(store) == 9 and store.labels.tolist() == [0] * 5 + [1] * 4


def test_two_ranks_write_the_same_bytes_as_one(reference, images, vae_dir, tmp_path):
    out = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "extract_features.py",
    ]
    result = subprocess.run(
        cmd + args(images, out, vae_dir), cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "rank 0 of 2" in result.stderr and "wrote 4 shards" in result.stdout
    assert files(out) == files(reference)


def test_killed_run_resumes_to_the_same_store(reference, vae_dir, tmp_path):
    """A FIFO posing as an image blocks the run deterministically inside shard 2; we SIGKILL it there."""
    data = make_image_folder(tmp_path / "images", COUNTS)
    real = Path(data, "b_dog", "img1.png")  # source 7: shard 2
    real.rename(tmp_path / "img1.png")
    os.mkfifo(real)
    out = tmp_path / "store"
    cmd = [sys.executable, "extract_features.py", *args(data, out, vae_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.DEVNULL)
    writer, deadline = None, time.time() + 900
    try:
        # until shard 1 is sealed and the run opened the FIFO: it waits on it then, however loaded the machine
        while writer is None:
            assert proc.poll() is None and time.time() < deadline, "extraction died or stalled before the FIFO"
            try:
                if (out / (shard_file(1) + ".sha256")).exists():
                    writer = os.open(real, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no reader has it open
            except OSError:
                pass
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if writer is not None:
            os.close(writer)
    shards = [shard_file(k) + e for k in (0, 1) for e in ("", ".sha256")]
    assert sorted(os.listdir(out)) == [".lock", MANIFEST, *shards]  # the lock's record: taken over on the rerun
    assert not json.loads((out / MANIFEST).read_text())["complete"]
    with pytest.raises(UserError, match="incomplete"):
        LatentStoreDataset(str(out))
    # What a kill at a worse moment would leave: a torn temp file, a shard renamed but not yet checksummed.
    (out / (shard_file(2) + ".tmp-12345")).write_bytes(b"torn")
    (out / (shard_file(1) + ".sha256")).unlink()
    assert extract("--features-path", str(out), "--verify") == 2

    real.unlink()
    (tmp_path / "img1.png").rename(real)
    assert extract(*args(data, out, vae_dir)) == 0
    assert files(out) == files(reference)


def test_truncated_shard_fails_verify_and_a_rerun_redoes_only_it(reference, images, vae_dir, tmp_path, capsys):
    out = tmp_path / "store"
    shutil.copytree(reference, out)
    assert extract("--features-path", str(out), "--verify") == 0
    shard = out / shard_file(1)
    shard.write_bytes(shard.read_bytes()[:-100])
    capsys.readouterr()
    assert extract("--features-path", str(out), "--verify") == 2
    assert "shard-00001.safetensors fails its sha256 check" in capsys.readouterr().err
    mtimes = {k: (out / shard_file(k)).stat().st_mtime_ns for k in (0, 2, 3)}
    assert extract(*args(images, out, vae_dir)) == 0
    assert "wrote 1 shards, reused 3 verified ones" in capsys.readouterr().out
    assert files(out) == files(reference)
    assert mtimes == {k: (out / shard_file(k)).stat().st_mtime_ns for k in (0, 2, 3)}


def test_strict_fails_on_problems(images, vae_dir, tmp_path, capsys):
    assert extract(*args(images, tmp_path / "a", vae_dir, "--strict")) == 2
    assert "notes.txt (not an image file)" in capsys.readouterr().err
    only_corrupt = tmp_path / "corrupt"
    shutil.copytree(Path(images, "a_cat"), only_corrupt / "a_cat")
    (only_corrupt / "a_cat" / "notes.txt").unlink()
    assert extract(*args(only_corrupt, tmp_path / "b", vae_dir, "--strict")) == 2
    assert "corrupt image" in capsys.readouterr().err


def test_bf16_encode_and_storage_without_flips(images, vae_dir, tmp_path):
    out = tmp_path / "bf16"
    assert extract(*args(images, out, vae_dir, "--precision", "bf16", "--storage-dtype", "bf16", "--no-flip")) == 0
    store = LatentStoreDataset(str(out))
    assert store.flip_mode == "latent" and store.manifest["encode_precision"] == "bf16"
    assert read_header(os.path.join(out, shard_file(0)))[0]["moments"]["shape"] == [2, 1, 2, 4, 4, 4]
    latents = torch.stack([x for x, _ in store.__getitems__(list(range(9)))])
    assert latents.dtype == torch.float32 and torch.isfinite(latents).all()


def test_bad_input_is_refused_and_nothing_is_overwritten(reference, images, vae_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    cases = [
        (args(tmp_path / "nowhere", tmp_path / "o1", vae_dir), "does not exist"),
        (args(tmp_path / "empty", tmp_path / "o2", vae_dir), "has no class sub-folders"),
        (args(images, tmp_path / "o3", tmp_path / "no-vae"), "no-vae"),
    ]
    for argv, message in cases:
        assert extract(*argv) == 2
        assert message in capsys.readouterr().err
    other_vae = tmp_path / "other-vae"
    build_tiny_vae(seed=1).save_pretrained(other_vae)
    out = tmp_path / "store"
    shutil.copytree(reference, out)
    data_files = [name for name in os.listdir(out) if name != ".lock"]  # the lock is taken and given back
    before = {name: (out / name).stat().st_mtime_ns for name in data_files}
    assert extract(*args(images, out, other_vae)) == 2
    err = capsys.readouterr().err
    assert f"store was made with {os.path.abspath(vae_dir)!r}" in err and "vae_weights_sha256" in err
    assert extract(*(args(images, out, vae_dir) + ["--image-size", "64"])) == 2
    assert "image_size: store has 32, this run has 64" in capsys.readouterr().err
    assert files(out) == files(reference)
    assert before == {name: (out / name).stat().st_mtime_ns for name in data_files}


def test_a_second_extraction_into_the_same_store_is_refused(images, vae_dir, tmp_path, capsys):
    """The second would delete the first one's temp files as a killed run's (reliability.md, row 1)."""
    from dit.io.atomic import FolderLock

    out = tmp_path / "store"
    holder = FolderLock(out, "extraction", "wait").acquire()  # as a running extraction holds it
    try:
        assert extract(*args(images, out, vae_dir)) == 2
        assert "is in use by another extraction" in capsys.readouterr().err
    finally:
        holder.release()
    assert extract(*args(images, out, vae_dir)) == 0


def test_progress_switch_and_the_summary_names_both_rates(images, vae_dir, tmp_path, capsys):
    """--progress/--no-progress as train.py and sample.py take it; the summary's rate included the start-up
    (4.1 img/s) while the bar showed the encoding's (27.8): both are printed, named."""
    import re

    capsys.readouterr()
    for switch, shown in (("--progress", True), ("--no-progress", False)):
        assert extract(*args(images, tmp_path / switch, vae_dir, switch)) == 0
        out, err = capsys.readouterr()
        assert ("encoding:" in err) == shown, err
        rates = re.search(r"([\d.]+) img/s overall \(start-up included\), ([\d.]+) img/s encoding", out)
        assert rates and float(rates[2]) >= float(rates[1]) > 0, out
