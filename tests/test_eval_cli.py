"""``python -m dit.eval``: end to end on digit and tiny Inception sets, every source kind, the one-line errors,
the in-memory Evaluator, and 2 processes against 1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_tiny_vae, make_image_folder
from PIL import Image

from dit.data.digits import digit_split, load_mnist_5k
from dit.data.store import sha256_file
from dit.eval import Evaluator, inception, load_feature_net, load_reference
from dit.eval.__main__ import main
from dit.eval.evaluator import judges_for
from dit.extract import ExtractConfig, extract_features
from dit.io.cli import run_cli

REPO = Path(__file__).resolve().parents[1]

SCORES = ("fid", "fd_judge", "inception_score", "precision", "recall", "class_accuracy", "num_images", "flops")


def cli(argv, capsys) -> tuple[int, str, str]:
    code = run_cli(main, [str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> dict[str, Path]:
    """npz sets: 1,000 training digits (100 per class), the 1,000 held-out ones with labels, and noise."""
    folder = tmp_path_factory.mktemp("digits")
    images, labels = load_mnist_5k()
    train, held_out = digit_split(labels)
    train = train[np.arange(len(train)) % 4 == 0]
    np.savez(folder / "train.npz", images[train][..., None])
    np.savez(folder / "held_out.npz", images[held_out][..., None], labels[held_out])
    noise = np.random.default_rng(0).normal(127.5, 127.5, (300, 28, 28, 1)).clip(0, 255).astype(np.uint8)
    np.savez(folder / "noise.npz", noise)
    return {name: folder / f"{name}.npz" for name in ("train", "held_out", "noise")}


@pytest.fixture(scope="module")
def digit_ref(digits, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "train_ref.npz"
    assert run_cli(main, ["ref", "--npz", str(digits["train"]), "--feature-net", "mnist", "--out", str(out)]) == 0
    return out


def test_digit_evaluation_end_to_end(digits, digit_ref, capsys):
    code, out, err = cli(["--samples", digits["held_out"], "--ref", digit_ref, "--json"], capsys)
    assert code == 0, err
    held = json.loads(out)
    assert held["num_images"] == 1000 and held["feature_network"].startswith("mnist-cnn-sha256:")
    assert held["class_accuracy"] >= 0.97 and held["inception_score"] > 8 and held["sfid"] is None
    assert held["precision"] > 0.8 and held["recall"] > 0.8 and held["sqrtm_eps_used"] == []
    net_flops = load_feature_net("mnist").flops_per_image() * 1000
    assert held["flops_breakdown"]["network"] == net_flops and held["flops"] > net_flops

    code, out, err = cli(["--samples", digits["noise"], "--ref", digit_ref, "--json"], capsys)
    assert code == 0, err
    noise = json.loads(out)
    assert noise["fid"] > 100 * held["fid"] and noise["class_accuracy"] is None and noise["precision"] < 0.05
    # the second judge, against the 4,000 training digits, and an interval on each Fréchet distance
    assert noise["fd_judge"] > 10 * held["fd_judge"] > 0
    for result in (held, noise):
        for key in ("fid", "fd_judge"):
            low, high = result["intervals"][key]
            assert low <= result[key] <= high and low < high
    judge_flops = load_feature_net("digit-judge").flops_per_image() * 1000
    assert held["flops_breakdown"]["judges"] == judge_flops

    code, out, _ = cli(["--samples", digits["held_out"], "--ref", digit_ref], capsys)
    assert code == 0 and "class accuracy" in out and "FLOPs" in out and "mnist-cnn-sha256" in out
    assert re.search(r"^FID +[\d.]+ \[[\d.]+, [\d.]+\]$", out, re.M)
    assert re.search(r"^digit judge FD +[\d.e+-]+ \[[\d.e+-]+, [\d.e+-]+\]$", out, re.M)


def test_a_folder_scores_like_its_npz(digits, digit_ref, tmp_path, capsys):
    with np.load(digits["held_out"]) as f:
        images = f["arr_0"][:200]
    for i, image in enumerate(images):
        Image.fromarray(image[..., 0]).save(tmp_path / f"{i:06d}.png")
    np.savez(tmp_path / "same.npz", np.repeat(images, 3, axis=-1))  # as RGB, the sampler's layout
    results = []
    for samples in (tmp_path, tmp_path / "same.npz"):
        code, out, err = cli(
            ["--samples", samples, "--ref", digit_ref, "--json", "--metrics", "fid,is,pr"], capsys
        )
        assert code == 0, err
        results.append(json.loads(out))
    assert {k: results[0][k] for k in ("fid", "inception_score", "precision", "recall")} == {
        k: results[1][k] for k in ("fid", "inception_score", "precision", "recall")
    }


def test_in_memory_evaluator_equals_the_command_line(digits, digit_ref, capsys):
    code, out, _ = cli(["--samples", digits["held_out"], "--ref", digit_ref, "--json"], capsys)
    expected = json.loads(out)
    with np.load(digits["held_out"]) as f:
        images, labels = torch.from_numpy(f["arr_0"]).permute(0, 3, 1, 2), torch.from_numpy(f["arr_1"])
    reference = load_reference(str(digit_ref))
    judges = judges_for(reference.feature_network)  # the command line's: the digit judge beside the digit FID
    evaluator = Evaluator(load_feature_net("mnist"), reference, judges=judges)
    batches = [(images[i : i + 128].float() / 127.5 - 1, labels[i : i + 128]) for i in range(0, 1000, 128)]
    got = evaluator.evaluate(batches)  # floats in [-1, 1], other batch boundaries
    for key in SCORES:
        assert got[key] == pytest.approx(expected[key], rel=1e-6), key


def test_user_mistakes_are_one_line_errors(digits, digit_ref, tmp_path, capsys):
    with np.load(digits["held_out"]) as f:
        few = f["arr_0"][:50]
    np.savez(tmp_path / "few.npz", few)
    np.savez(tmp_path / "big.npz", np.zeros((70, 32, 32, 3), np.uint8))
    np.savez(tmp_path / "float.npz", np.zeros((70, 28, 28, 3), np.float32))
    cases = [
        (["--samples", tmp_path / "few.npz", "--ref", digit_ref], "has 50 images, too few .* at least 65"),
        (["--samples", tmp_path / "big.npz", "--ref", digit_ref], "takes 28x28 images, got 32x32"),
        (["--samples", tmp_path / "float.npz", "--ref", digit_ref], "must be uint8 images"),
        (["--samples", digits["noise"], "--ref", digit_ref, "--metrics", "sfid"], "sfid needs a network"),
        (["--samples", digits["noise"], "--ref", tmp_path / "none.npz"], "no such file"),
        (["--samples", digits["noise"], "--ref", digits["train"]], "python -m dit.eval ref --npz"),
    ]
    for argv, message in cases:
        code, out, err = cli(argv, capsys)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
        assert re.search(message, err), (message, err)


def test_inception_end_to_end_offline(inception_weights, tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "ref_set.npz", rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8))
    np.savez(tmp_path / "samples.npz", rng.integers(0, 256, (5, 16, 16, 3), dtype=np.uint8))
    weights = ["--inception-weights", inception_weights]
    code, out, err = cli(
        ["ref", "--npz", tmp_path / "ref_set.npz", "--out", tmp_path / "ref.npz", *weights], capsys
    )
    assert code == 0, err
    assert "FID against these statistics needs at least 2049" in out
    ref = load_reference(str(tmp_path / "ref.npz"))
    assert ref.features.shape == (6, 2048) and ref.mu_s.shape == (2023,) and ref.sigma_s.shape == (2023, 2023)

    argv = ["--samples", tmp_path / "samples.npz", "--ref", tmp_path / "ref.npz", *weights, "--json"]
    code, out, err = cli([*argv, "--metrics", "is,pr"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["num_images"] == 5 and result["feature_network"] == ref.feature_network
    assert 1.0 <= result["inception_score"] <= 5 and 0 <= result["precision"] <= 1 and result["fid"] is None
    assert (
        result["flops_breakdown"]["network"]
        == 5 * load_feature_net("inception", inception_weights).flops_per_image()
    )

    code, _, err = cli(argv, capsys)  # FID and sFID by default: 5 images are far too few
    assert code == 2 and "has 5 images" in err and "at least 2049" in err

    other = tmp_path / "other.pth"
    torch.save(
        {k: v + 0.01 if v.is_floating_point() else v for k, v in torch.load(inception_weights).items()}, other
    )
    code, _, err = cli([*argv[:4], "--inception-weights", other, "--metrics", "is"], capsys)
    assert code == 2 and "statistics of two networks cannot be compared" in err


def test_adm_reference_batch(inception_weights, tmp_path, capsys, monkeypatch):
    """An ADM-style file (mu, sigma, arr_0); the random weights stand in for the TF ones."""
    monkeypatch.setattr(inception, "INCEPTION_SHA256_PREFIX", sha256_file(inception_weights)[:8])
    rng = np.random.default_rng(1)
    arr_0 = rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    np.savez(tmp_path / "adm.npz", arr_0=arr_0, mu=np.zeros(2048), sigma=np.eye(2048))
    np.savez(tmp_path / "samples.npz", rng.integers(0, 256, (5, 16, 16, 3), dtype=np.uint8))
    weights = ["--inception-weights", inception_weights]
    base = ["--samples", tmp_path / "samples.npz", *weights, "--json", "--metrics", "pr"]
    code, out, err = cli([*base, "--ref", tmp_path / "adm.npz"], capsys)
    assert code == 0, err
    direct = json.loads(out)
    assert (
        direct["flops_breakdown"]["network"]
        == 11 * load_feature_net("inception", inception_weights).flops_per_image()
    )

    code, _, err = cli(["ref", "--adm", tmp_path / "adm.npz", "--out", tmp_path / "ours.npz", *weights], capsys)
    assert code == 0, err
    ours = load_reference(str(tmp_path / "ours.npz"))
    assert (
        ours.num_images is None and ours.features.shape == (6, 2048) and np.array_equal(ours.sigma, np.eye(2048))
    )
    code, out, err = cli([*base, "--ref", tmp_path / "ours.npz"], capsys)
    assert code == 0, err
    converted = json.loads(out)
    assert (converted["precision"], converted["recall"]) == (direct["precision"], direct["recall"])
    assert (
        converted["flops_breakdown"]["network"]
        == 5 * load_feature_net("inception", inception_weights).flops_per_image()
    )


def test_reference_from_a_latent_store(vae_dir, inception_weights, tmp_path, capsys):
    make_image_folder(tmp_path / "images", counts={"a": 3, "b": 2})
    store = tmp_path / "store"
    extract_features(
        ExtractConfig(
            data_path=str(tmp_path / "images"), feature_path=str(store), image_size=32, vae=vae_dir, num_workers=0
        )
    )
    weights = ["--inception-weights", inception_weights]
    code, out, err = cli(["ref", "--latents", store, "--out", tmp_path / "ref.npz", *weights], capsys)
    assert code == 0, err
    ref = load_reference(str(tmp_path / "ref.npz"))
    assert ref.num_images == 5 and ref.source.startswith("latent store") and ref.features.shape == (5, 2048)

    other_vae = tmp_path / "other_vae"
    build_tiny_vae(seed=1).save_pretrained(other_vae)
    code, _, err = cli(
        ["ref", "--latents", store, "--vae", other_vae, "--out", tmp_path / "x.npz", *weights], capsys
    )
    assert code == 2 and "is not the one that made latent store" in err


@pytest.mark.slow
def test_two_processes_equal_one(digits, digit_ref):
    """Bit-identical where every process runs the feature network on as many threads (torchrun gives each
    worker one, so the one-process run gets OMP_NUM_THREADS=1): the same batches in the same order. Across
    thread counts BLAS may add float32 partial sums in another order: FID moved by 3.4e-9 relative on one
    x86 machine (0 on this project's), so that case is held to float32 reduction noise (docs/evaluation.md)."""

    def run(*prefix, batch_size=96, threads=None):
        args = [sys.executable, *prefix, "-m", "dit.eval", "--samples", str(digits["held_out"])]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        proc = subprocess.run(
            [*args, "--ref", str(digit_ref), "--json", "--batch-size", str(batch_size), "--device", "cpu"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={**env, "OMP_NUM_THREADS": str(threads)} if threads else env,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    one_thread, one = run(threads=1), run(threads=2)
    two = run(*torchrun)
    alone = run(*torchrun, batch_size=1000)  # one batch: rank 1 has nothing to embed but still gathers
    assert (one["processes"], two["processes"], alone["processes"]) == (1, 2, 2)
    for key in SCORES:
        assert two[key] == one_thread[key], key
        assert two[key] == pytest.approx(one[key], rel=1e-6, abs=1e-12), key
        assert alone[key] == pytest.approx(one[key], rel=1e-6), key
