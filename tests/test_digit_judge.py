"""The digit judge: its training script is deterministic, and the committed weights are the ones its report
names."""

from __future__ import annotations

import json

import numpy as np
import torch
from helpers import face

from dit.data.store import sha256_file
from dit.eval.digit_nets import DIGIT_JUDGE_REFERENCE, DIGIT_JUDGE_WEIGHTS, load_digit_judge
from dit.eval.reference import digits_reference, load_reference


def test_the_training_script_is_deterministic(tmp_path):
    train_digit_judge = face("studies/train_digit_judge.py")
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        for name in ("a", "b"):
            argv = ["--steps", "3", "--batch-size", "16", "--out", str(tmp_path / f"{name}.safetensors"),
                    "--reference-out", str(tmp_path / f"{name}.npz")]  # fmt: skip
            assert train_digit_judge.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    other = ["--steps", "3", "--batch-size", "16", "--seed", "1", "--out", str(tmp_path / "c.safetensors"),
             "--reference-out", str(tmp_path / "c.npz")]  # fmt: skip
    try:
        train_digit_judge.main(other)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    assert (tmp_path / "c.safetensors").read_bytes() != (tmp_path / "a.safetensors").read_bytes()


def test_the_committed_weights_load_and_match_their_report():
    report = json.loads(DIGIT_JUDGE_WEIGHTS.with_suffix(".json").read_text())
    assert report["sha256"] == sha256_file(DIGIT_JUDGE_WEIGHTS) and report["labels_used_for_training"] is False
    net = load_digit_judge()
    assert net.name == f"digit-judge-sha256:{report['sha256'][:16]}"
    out = net(torch.zeros(3, 1, 28, 28, dtype=torch.uint8))
    assert set(out) == {"pool"} and out["pool"].shape == (3, 64)
    committed = load_reference(str(DIGIT_JUDGE_REFERENCE))
    fresh = digits_reference(net)  # what the script wrote: the 4,000 training digits under these weights
    assert committed.feature_network == net.name and committed.num_images == 4000
    assert np.allclose(committed.mu, fresh.mu, atol=1e-9) and np.allclose(committed.sigma, fresh.sigma, atol=1e-9)
