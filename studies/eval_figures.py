"""The figures of docs/evaluation.md: the digit metric's targets and what an evaluation costs.

    python studies/eval_figures.py --out docs/results/eval_figures.json

Writes the digit sets it scores (.npz, as ``python -m dit.eval`` reads them) and the training digits'
statistics into ``--results-dir`` (default out/eval_digits), so each row can be rerun with the command the JSON
records. Then: held-out digits, 1,000 training digits and Gaussian noise against the training statistics;
seconds per 1,000 digits on this machine (median of 3); precision/recall with float16 distances (ADM's)
against float32 (ours) on the digits and on synthetic 2048-d features; Inception-v3's FLOPs per image at 299 px from the
counter, and its seconds per image here with random weights (the cost does not depend on the weights).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dit.data.digits import digit_split, load_mnist_5k
from dit.eval.digit_nets import load_digit_classifier
from dit.eval.evaluator import Evaluator, extract_features, shard_batches
from dit.eval.inception import InceptionFeatures
from dit.eval.metrics import (
    PR_BATCH_SIZE,
    PR_DISTANCES,
    PR_NEIGHBOURS,
    knn_radii,
    pairwise_flops,
    precision_recall,
)
from dit.eval.reference import load_reference, save_stats, stats_from_features
from dit.eval.sources import NpzImages
from dit.io.cli import run_cli
from dit.io.config import Section, option
from dit.io.face import Face
from seeded import command, report

MNIST_BATCH = 500


def write_sets(folder: Path) -> dict[str, Path]:
    """The MNIST-5k split as .npz sample sets (held-out digits with their labels as arr_1) and 1,000 images
    of Gaussian noise N(127.5, 127.5²) clipped to [0, 255]."""
    images, labels = load_mnist_5k()
    train, held_out = digit_split(labels)
    first, rest = train[np.arange(len(train)) % 4 == 0], train[np.arange(len(train)) % 4 != 0]
    noise = np.random.default_rng(0).normal(127.5, 127.5, (1000, 28, 28, 1)).clip(0, 255).astype(np.uint8)
    sets = {
        "train": (images[train][..., None], None),
        "train_rest": (images[rest][..., None], None),
        "train_quarter": (images[first][..., None], labels[first]),
        "held_out": (images[held_out][..., None], labels[held_out]),
        "noise": (noise, None),
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, arrays in sets.items():
        np.savez(folder / f"{name}.npz", *(a for a in arrays if a is not None))
    return {name: folder / f"{name}.npz" for name in sets}


def reference(net, sets: Path, name: str) -> Path:
    images = NpzImages(str(sets / f"{name}.npz"))
    features, _ = extract_features(net, shard_batches(images, MNIST_BATCH))
    path = sets / f"{name}_ref.npz"
    save_stats(str(path), stats_from_features(features, net.name, images.describe()))
    return path


def score(net, samples: Path, ref: Path, **options) -> dict:
    evaluator = Evaluator(net, load_reference(str(ref)), batch_size=MNIST_BATCH, **options)
    result = evaluator.evaluate(shard_batches(NpzImages(str(samples)), MNIST_BATCH))
    result["command"] = f"python -m dit.eval --samples {samples} --ref {ref} --json"
    return result


def pr_both(net, samples: Path, ref: Path) -> dict:
    """Precision and recall with float32 distances (ours) and float16 ones (ADM's, --pr-distances float16)."""
    out = {}
    for distances in PR_DISTANCES:
        result = score(net, samples, ref, metrics=["pr"], pr_distances=distances)
        out[distances] = {"precision": result["precision"], "recall": result["recall"]}
    out["command"] = f"python -m dit.eval --samples {samples} --ref {ref} --metrics pr --pr-distances float16"
    return _differences(out)


def pr_synthetic(n: int = 5000, dim: int = 2048) -> dict:
    """Inception's size without its weights (none download here): non-negative, skewed features like pooled
    ReLU outputs, i.i.d. Gamma(0.5, 0.8) (mean 0.4), samples from a distribution 5% wider than the reference's."""
    g = np.random.default_rng(0)
    ref = torch.from_numpy(g.gamma(0.5, 0.8, (n, dim)).astype(np.float32))
    samples = torch.from_numpy(g.gamma(0.5, 0.84, (n, dim)).astype(np.float32))
    out = {"what": f"{n:,} vs {n:,} synthetic {dim}-d features, Gamma(0.5, 0.8) and Gamma(0.5, 0.84)"}
    for distances in PR_DISTANCES:
        radii = [knn_radii(x, PR_NEIGHBOURS, PR_BATCH_SIZE, distances) for x in (ref, samples)]
        precision, recall = precision_recall(ref, radii[0], samples, radii[1], PR_BATCH_SIZE, distances)
        out[distances] = {"precision": precision, "recall": recall}
    return _differences(out)


def _differences(out: dict) -> dict:
    out["abs_difference"] = {k: abs(out["float16"][k] - out["float32"][k]) for k in ("precision", "recall")}
    return out


@dataclass(frozen=True)
class FiguresConfig(Section):
    """The flags: where the JSON and the digit sets go."""

    out: str = option(
        "out/eval_figures.json",
        "write the figures here (JSON; docs/results/eval_figures.json is the committed one)",
    )
    results_dir: str = option("out/eval_digits", "folder for the digit sets and statistics", aliases=("--sets",))


FACE = Face(
    "studies/eval_figures.py",
    __doc__,
    sections={"figures": FiguresConfig},
    outputs={"out": "file", "results_dir": "folder"},
)


def main(argv: list[str] | None = None) -> int:
    args = FACE.parse(argv).sections["figures"]
    sets = Path(args.results_dir)
    paths = write_sets(sets)
    net = load_digit_classifier()
    train_ref, rest_ref = reference(net, sets, "train"), reference(net, sets, "train_rest")
    figures = {
        "command": command("eval_figures.py", argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        "reference": f"{train_ref} (4,000 training digits, 400 per class)",
        "held_out_vs_train": score(net, paths["held_out"], train_ref),
        "noise_vs_train": score(net, paths["noise"], train_ref),
        # The floor a finite set sets: 1,000 training digits against the other 3,000 (one distribution).
        "train_quarter_vs_train_rest": score(net, paths["train_quarter"], rest_ref),
    }
    figures["noise_over_held_out_fid"] = figures["noise_vs_train"]["fid"] / figures["held_out_vs_train"]["fid"]

    runs = [score(net, paths["held_out"], train_ref)["seconds"] for _ in range(3)]
    per_image = net.flops_per_image()
    figures["digit_cost_per_1000"] = {
        "network_flops": per_image * 1000,
        "precision_recall_flops_vs_4000": figures["held_out_vs_train"]["flops_breakdown"]["precision_recall"],
        "seconds_median_of_3": statistics.median(runs),
        "seconds_runs": runs,
        "what": "embed 1,000 digits, FID, IS, precision/recall against 4,000, accuracy (reading excluded)",
    }

    refs = {"train": train_ref, "train_rest": rest_ref}
    pairs = (("held_out", "train"), ("noise", "train"), ("train_quarter", "train_rest"))
    figures["pr_float16_vs_float32"] = {f"{s}_vs_{r}": pr_both(net, paths[s], refs[r]) for s, r in pairs}
    figures["pr_float16_vs_float32"]["synthetic_2048d"] = pr_synthetic()

    inception = InceptionFeatures(None, "random weights: the cost does not depend on them").eval()
    batch = torch.randint(0, 256, (16, 3, 256, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        inception(batch[:2])  # warm-up
        start = time.perf_counter()
        inception(batch)
        seconds = (time.perf_counter() - start) / len(batch)
    flops = inception.flops_per_image()
    pr_50k = pairwise_flops(50_000, 50_000, 2048) + pairwise_flops(10_000, 10_000, 2048)
    figures["inception"] = {
        "flops_per_image_299px": flops,
        "flops_per_1000_images": flops * 1000,
        "precision_recall_flops_1000_vs_10000_ref": pairwise_flops(1000, 1000, 2048)
        + pairwise_flops(10_000, 1000, 2048),
        "seconds_per_image_cpu_measured_on_16_images_256px": seconds,
        "adm_fid_50k_flops": flops * 60_000 + pr_50k + pairwise_flops(10_000, 50_000, 2048),
        "adm_fid_50k_what": "50,000 samples + ADM's 10,000 reference images through Inception, P/R in blocks "
        f"of {PR_BATCH_SIZE:,}",
    }
    return report(figures, args.out)


if __name__ == "__main__":
    sys.exit(run_cli(main))
