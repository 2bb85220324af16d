"""Class-balanced sample sets (issue 39, item 3): exactly N // C images per class and the remainder spread by
the recorded rule, on 1 and 2 processes and across a resume; ``random`` as today's labels; the mode
recorded in the set, reported with its scores, and never mixed within a set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers import run_face, write_our_checkpoint

from dit.runtime import Stream, mix_seed
from dit.sample.labels import REMAINDER_RULE, extra_classes, set_labels

ROOT = Path(__file__).resolve().parents[1]
N, C = 70, 3  # 23 images per class and one left over: the digit judge's smallest set (65) and a remainder


def expected_counts(seed: int, n: int, classes: int) -> Counter:
    extra = extra_classes(seed, n, classes)
    return Counter({c: n // classes + (c in extra) for c in range(classes)})


@pytest.mark.parametrize("n, classes", [(20, 5), (23, 10), (7, 10), (1000, 7), (1, 3)])
def test_balanced_labels_have_exact_counts_and_the_remainder_goes_to_seeded_classes(n, classes):
    for seed in (0, 1, 2**40):
        labels = set_labels("balanced", seed, n, classes)
        counts = Counter(labels)
        assert len(labels) == n and set(counts) <= set(range(classes))
        assert sorted(counts[c] for c in range(classes)) == sorted([n // classes] * (classes - n % classes)
                                                                   + [n // classes + 1] * (n % classes))  # fmt: skip
        extra = extra_classes(seed, n, classes)
        assert len(extra) == n % classes and all(counts[c] == n // classes + 1 for c in extra)
        assert labels == set_labels("balanced", seed, n, classes), "the same (seed, N, C): the same labels"
    # the remainder's classes and the order follow the seed, not the class index
    assert len({tuple(extra_classes(s, 23, 10)) for s in range(8)}) > 1
    assert len({tuple(set_labels("balanced", s, 20, 5)) for s in range(4)}) == 4


def test_random_labels_are_todays_and_unbalanced():
    """``random`` keeps the labels every set drew before the modes: mix_seed(Stream.LABEL, seed, i) mod C."""
    for seed, n, classes in ((0, 50, 10), (7, 33, 1000)):
        today = [mix_seed(Stream.LABEL, seed, i) % classes for i in range(n)]
        assert set_labels("random", seed, n, classes) == today
    assert len(set(Counter(set_labels("random", 0, 1000, 10)).values())) > 1, "random counts vary"
    assert set_labels("balanced", 0, 5, 0) == set_labels("random", 0, 5, 0) == [0] * 5  # unconditional


def fid_args(ckpt, sample_dir, *extra) -> list[str]:
    args = ["--ckpt", ckpt, "--sample-dir", sample_dir, "--num-fid-samples", N, "--per-proc-batch-size", 20,
            "--num-sampling-steps", 2, "--sampler", "ddim", "--precision", "fp32", "--peak-tflops", 1, *extra]  # fmt: skip
    return [str(a) for a in args]


def the_set(sample_dir: Path) -> tuple[Path, Path]:
    (npz,) = Path(sample_dir).glob("*.npz")
    return npz, npz.with_suffix("")


@pytest.fixture(scope="module")
def digit_ckpt(tmp_path_factory) -> Path:
    """A 28x28 one-channel pixel model of 3 classes (random weights): the digit judges can score its sets."""
    folder = tmp_path_factory.mktemp("ckpt")
    return write_our_checkpoint(folder, None, in_channels=1, input_size=28, patch_size=4, num_classes=C)


@pytest.fixture(scope="module")
def one_process(digit_ckpt, tmp_path_factory) -> Path:
    from helpers import face

    from dit.io.cli import run_cli

    sample_dir = tmp_path_factory.mktemp("one")
    assert run_cli(face("scripts/sample_ddp.py").main, fid_args(digit_ckpt, sample_dir)) == 0
    return sample_dir


def test_a_set_is_balanced_by_default_and_records_how(one_process):
    npz, folder = the_set(one_process)
    with np.load(npz) as f:
        labels, mode = f["arr_1"].tolist(), str(f["label_mode"])
    assert mode == "balanced" and labels == set_labels("balanced", 0, N, C)
    assert Counter(labels) == expected_counts(0, N, C)
    record = json.loads((folder / "sample_set.json").read_text())
    assert record["labels"] == "balanced"
    assert record["label_counts"] == {"num_samples": N, "num_classes": C, "per_class": N // C, "remainder": N % C,
                                      "remainder_rule": REMAINDER_RULE, "extra_classes": extra_classes(0, N, C)}  # fmt: skip


def test_two_processes_write_the_same_balanced_labels(digit_ckpt, one_process, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*torchrun, str(ROOT / "scripts/sample_ddp.py"), *fid_args(digit_ckpt, tmp_path, "--device", "cpu")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "balanced labels" in proc.stdout
    with np.load(the_set(one_process)[0]) as a, np.load(the_set(tmp_path)[0]) as b:
        assert Counter(b["arr_1"].tolist()) == expected_counts(0, N, C)
        assert np.array_equal(a["arr_1"], b["arr_1"]) and np.array_equal(a["arr_0"], b["arr_0"])


def test_a_resumed_set_keeps_its_mode_and_its_counts(digit_ckpt, one_process, tmp_path, capsys):
    import shutil

    shutil.copytree(one_process, tmp_path, dirs_exist_ok=True)
    npz, folder = the_set(tmp_path)
    npz.unlink()
    for i in range(30, N):  # a kill after the first batch and a half
        (folder / f"{i:06d}.png").unlink()
    code, out, err = run_face("scripts/sample_ddp.py", fid_args(digit_ckpt, tmp_path), capsys)
    assert code == 0, err
    with np.load(npz) as f, np.load(the_set(one_process)[0]) as whole:
        assert Counter(f["arr_1"].tolist()) == expected_counts(0, N, C)
        assert np.array_equal(f["arr_1"], whole["arr_1"]) and str(f["label_mode"]) == "balanced"

    code, out, err = run_face(
        "scripts/sample_ddp.py", fid_args(digit_ckpt, tmp_path, "--labels", "random"), capsys
    )
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert "made with balanced labels, not random: pass --labels balanced" in err


def test_a_set_recorded_before_the_modes_continues_random_and_refuses_balanced(digit_ckpt, one_process, tmp_path,
                                                                                capsys):  # fmt: skip
    """An old set's record has no label mode: its labels were random, and it stays random."""
    args = fid_args(digit_ckpt, tmp_path, "--labels", "random")
    assert run_face("scripts/sample_ddp.py", args, capsys)[0] == 0
    npz, folder = the_set(tmp_path)
    record = json.loads((folder / "sample_set.json").read_text())
    assert record["labels"] == "random" and "label_counts" not in record
    with np.load(npz) as f:
        random = f["arr_1"].tolist()
    assert random == set_labels("random", 0, N, C)
    del record["labels"]  # what a set written before this change holds
    (folder / "sample_set.json").write_text(json.dumps(record, indent=1))
    npz.unlink()
    (folder / "000069.png").unlink()
    code, _, err = run_face("scripts/sample_ddp.py", fid_args(digit_ckpt, tmp_path), capsys)  # no --labels
    assert code == 0, err
    with np.load(npz) as f:
        assert f["arr_1"].tolist() == random and str(f["label_mode"]) == "random"
    code, _, err = run_face(
        "scripts/sample_ddp.py", fid_args(digit_ckpt, tmp_path, "--labels", "balanced"), capsys
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "made with random labels, not balanced" in err


def test_the_evaluator_reports_the_mode_with_the_scores(one_process, tmp_path, capsys):
    from dit.eval.__main__ import main as eval_main
    from dit.eval.digit_nets import load_digit_classifier
    from dit.eval.reference import digits_reference, save_stats
    from dit.io.cli import run_cli

    npz, folder = the_set(one_process)
    ref = tmp_path / "digits_ref.npz"
    save_stats(str(ref), digits_reference(load_digit_classifier()))
    args = ["--samples", str(npz), "--ref", str(ref), "--bootstrap", "0"]
    assert run_cli(eval_main, [*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["labels"] == "balanced"
    assert run_cli(eval_main, ["--samples", str(folder), "--ref", str(ref), "--bootstrap", "0"]) == 0
    assert "labels         balanced" in capsys.readouterr().out, "a set's folder: its record's mode"
    with np.load(npz) as f:  # an .npz with labels and no mode: one written before the modes, or ADM's
        np.savez(old := tmp_path / "old.npz", arr_0=f["arr_0"], arr_1=f["arr_1"])
    assert run_cli(eval_main, ["--samples", str(old), "--ref", str(ref), "--bootstrap", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["labels"] == "random"


def test_in_loop_evaluations_are_balanced_and_say_so(tmp_path, monkeypatch):
    from test_eval_inloop import digits, eval_config, records

    from dit.eval.digit_nets import load_digit_classifier
    from dit.eval.inloop import InLoopEval
    from dit.eval.reference import digits_reference, save_stats
    from dit.train import train

    ref = tmp_path / "digits_ref.npz"
    save_stats(str(ref), digits_reference(load_digit_classifier()))
    seen, real = [], InLoopEval.run

    def keep_labels(self, *a, **kw):
        seen.append(list(self.labels))
        return real(self, *a, **kw)

    monkeypatch.setattr(InLoopEval, "run", keep_labels)
    cfg = eval_config(tmp_path, str(ref), max_steps=2)
    train(cfg, digits())
    (row,) = [r for r in records(tmp_path / "run") if r["kind"] == "eval"]
    assert row["eval_labels"] == "balanced"
    assert seen == [set_labels("balanced", mix_seed(Stream.EVAL, cfg.optim.seed), 70, 10)]
    assert set(Counter(seen[0]).values()) == {7}


def test_a_run_recorded_before_the_modes_resumes_with_random_evaluation_labels():
    from dit.train.config import TRAIN_FACE, run_record

    old = {"config": {"eval": {"every": 10, "ref": "ref.npz"}, "model": {"model": "DiT-S/2"}}}
    assert run_record(old)["eval_labels"] == "random"
    resumed = TRAIN_FACE.values([]).under(run_record(old)).values  # a resume lays the record under the flags
    assert TRAIN_FACE.section("eval", resumed).labels == "random"
    assert TRAIN_FACE.section("eval", TRAIN_FACE.values([]).values).labels == "balanced"
