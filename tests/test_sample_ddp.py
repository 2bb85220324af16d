"""scripts/sample_ddp.py: the npz format, the same set on 1 and 2 ranks, and resuming without duplicates or gaps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import face, run_face

from dit.io.cli import run_cli
from dit.io.errors import UserError
from dit.sample.fid_set import pack_npz, png_path
from dit.sample.labels import set_labels

ROOT = Path(__file__).resolve().parents[1]
N, BATCH = 6, 2


def fid_args(ckpt, sample_dir, *extra) -> list[str]:
    args = ["--ckpt", ckpt, "--sample-dir", sample_dir, "--num-fid-samples", N, "--per-proc-batch-size", BATCH]
    args += ["--num-sampling-steps", 10, "--precision", "fp32", "--peak-tflops", 1, *extra]
    return [str(a) for a in args]


def the_set(sample_dir: Path) -> tuple[Path, Path]:
    (npz,) = sample_dir.glob("*.npz")
    return npz, npz.with_suffix("")


@pytest.fixture(scope="module")
def one_rank(our_ckpt, tmp_path_factory) -> Path:  # noqa: F811
    """The set written by one in-process rank: the reference the other tests compare against."""
    sample_dir = tmp_path_factory.mktemp("one_rank")
    assert run_cli(face("scripts/sample_ddp.py").main, fid_args(our_ckpt, sample_dir)) == 0
    return sample_dir


def test_npz_has_the_evaluator_format(one_rank):
    npz, folder = the_set(one_rank)
    with np.load(npz) as f:
        assert list(f.keys()) == ["arr_0", "arr_1", "label_mode"]
        arr, labels = f["arr_0"], f["arr_1"]
    assert arr.dtype == np.uint8 and arr.shape == (N, 64, 64, 3)
    assert labels.dtype == np.int64 and labels.tolist() == set_labels("balanced", 0, N, 10)
    assert sorted(p.name for p in folder.glob("*.png")) == [f"{i:06d}.png" for i in range(N)]
    assert len({arr[i].tobytes() for i in range(N)}) == N, "every sample must be its own image"


def test_two_ranks_write_the_same_set_as_one(our_ckpt, one_rank, tmp_path):  # noqa: F811
    """One torchrun (gloo on CPU); torchrun also sets one thread per worker, as the in-process run does."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    cmd = torchrun + [str(ROOT / "scripts/sample_ddp.py"), *fid_args(our_ckpt, tmp_path, "--device", "cpu")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mine = sum(min(BATCH, N - b) for b in range(0, N, BATCH)[::2])  # rank 0 makes batches 0, 2, ...
    assert f"sampling (rank 0 of 2): {mine}/{mine} img (100%)" in proc.stderr, (
        "rank 0 shows its progress, in lines"
    )
    assert proc.stdout.count("wrote") == 1, "only rank 0 packs and reports"
    with np.load(the_set(one_rank)[0]) as a, np.load(the_set(tmp_path)[0]) as b:
        assert np.array_equal(a["arr_0"], b["arr_0"])


def test_a_killed_run_resumes_without_duplicates_or_gaps(our_ckpt, one_rank, tmp_path, capsys):  # noqa: F811
    shutil.copytree(one_rank, tmp_path, dirs_exist_ok=True)
    npz, folder = the_set(tmp_path)
    reference = np.load(npz)["arr_0"]
    npz.unlink()
    # What a kill leaves: one batch with one PNG written, one batch not started, a half-written temp file.
    png_path(folder, 3).unlink()
    png_path(folder, 4).unlink()
    png_path(folder, 5).unlink()
    (folder / "000004.png.tmp-abc123").write_bytes(b"\x89PNG half")  # atomic_write's temporary name
    kept = {i: png_path(folder, i).stat().st_mtime_ns for i in (0, 1)}

    code, out, err = run_face("scripts/sample_ddp.py", fid_args(our_ckpt, tmp_path), capsys)
    assert code == 0, err
    # Batch [2, 3] is made again whole (its numerics depend on its batch), batch [0, 1] is left alone.
    assert "4 images in" in out, "the two unfinished batches (4 images) are made again, nothing else"
    assert {i: png_path(folder, i).stat().st_mtime_ns for i in (0, 1)} == kept
    assert not list(folder.glob("*.tmp-*"))
    assert sorted(p.name for p in folder.glob("*.png")) == [f"{i:06d}.png" for i in range(N)]
    assert np.array_equal(np.load(npz)["arr_0"], reference)


def test_a_finished_set_is_not_sampled_again(our_ckpt, one_rank, capsys):  # noqa: F811
    code, out, err = run_face("scripts/sample_ddp.py", fid_args(our_ckpt, one_rank), capsys)
    assert code == 0, err
    assert "images in" not in out  # no cost line: nothing was generated


def test_a_folder_made_with_other_settings_is_refused(our_ckpt, one_rank, capsys):  # noqa: F811
    code, _, err = run_face("scripts/sample_ddp.py", fid_args(our_ckpt, one_rank, "--precision", "tf32"), capsys)
    assert code == 2 and "holds samples made with other settings" in err


def test_missing_samples_are_named_when_packing(tmp_path):
    (tmp_path / "set").mkdir()
    with pytest.raises(UserError, match=r"3 of 3 samples are missing"):
        pack_npz(tmp_path / "set", 3, tmp_path / "set.npz")
    assert not (tmp_path / "set.npz").exists()


def test_bad_fid_requests(our_ckpt, tmp_path, capsys):  # noqa: F811
    code, _, err = run_face("scripts/sample_ddp.py", fid_args(our_ckpt, tmp_path, "--cfg-scale", "0.9"), capsys)
    assert code == 2 and "--cfg-scale) must be >= 1" in err
    code, _, err = run_face("scripts/sample_ddp.py", fid_args(tmp_path / "x.pt", tmp_path), capsys)
    assert code == 2 and "does not exist" in err
    assert torch.get_num_threads() == 1


def test_a_digit_set_carries_its_labels_and_dit_eval_scores_its_class_accuracy(tmp_path, capsys):
    """A 28x28 one-channel pixel model (random weights) writes a set whose arr_1 the digit classifier reads."""
    from helpers import write_our_checkpoint

    from dit.eval.__main__ import main as eval_main
    from dit.eval.digit_nets import load_digit_classifier
    from dit.eval.reference import digits_reference, save_stats

    ckpt = write_our_checkpoint(tmp_path, None, in_channels=1, input_size=28, patch_size=4)
    args = ["--ckpt", ckpt, "--sample-dir", tmp_path / "fid", "--num-fid-samples", 70, "--per-proc-batch-size", 35,
            "--num-sampling-steps", 2, "--sampler", "ddim", "--precision", "fp32", "--peak-tflops", 1]  # fmt: skip
    assert run_face("scripts/sample_ddp.py", [str(a) for a in args], capsys)[0] == 0
    npz, _ = the_set(tmp_path / "fid")
    ref = tmp_path / "digits_ref.npz"
    save_stats(str(ref), digits_reference(load_digit_classifier()))
    assert run_cli(eval_main, ["--samples", str(npz), "--ref", str(ref), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 <= result["class_accuracy"] <= 1 and result["num_images"] == 70
