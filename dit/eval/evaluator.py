"""The evaluator: image batches in (NCHW uint8 or [-1, 1], optionally labelled), scores, intervals and their cost
out; under torch.distributed each rank passes its slice and the features are gathered in rank order."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dit.eval.digit_nets import DIGIT_JUDGE_REFERENCE, load_digit_judge
from dit.eval.dinov2 import load_dinov2
from dit.eval.feature_net import FeatureNet
from dit.eval.features import judge_key
from dit.eval.metrics import (
    BOOTSTRAP_RESAMPLES,
    PR_BATCH_SIZE,
    PR_NEIGHBOURS,
    check_enough_images,
    class_accuracy,
    fd_interval,
    frechet_distance,
    inception_score,
    knn_radii,
    mean_cov,
    pairwise_flops,
    precision_recall,
)
from dit.eval.reference import ReferenceStats, load_reference
from dit.io.errors import UserError
from dit.runtime import Runtime

METRICS = ("fid", "sfid", "is", "pr", "accuracy")
JUDGE_SCORES = ("fd_dinov2", "fd_judge")  # second judges' Fréchet distances
SCORES = ("fid", "sfid", "inception_score", "precision", "recall", "class_accuracy", *JUDGE_SCORES)


@dataclass(frozen=True)
class Judge:
    """A second judge: a network, its reference statistics, and the key its Fréchet distance is reported as."""

    key: str
    net: FeatureNet
    reference: ReferenceStats


def judges_for(
    network: str, judge_ref: str | None = None, dinov2_weights: str | None = None, device="cpu"
) -> list[Judge]:
    """The second judges: the digit judge where the digit classifier scores, and ``judge_ref``'s."""
    judges = []
    if judge_ref is not None:
        reference = load_reference(judge_ref)
        key = judge_key(reference.feature_network)
        if key is None:
            raise UserError(
                f"--judge-ref {judge_ref} holds {reference.feature_network} statistics, not a judge's: write them "
                "with python -m dit.eval ref --feature-net dinov2 (or digit-judge)."
            )
        net = load_dinov2(dinov2_weights, device) if key == "fd_dinov2" else load_digit_judge(device=device)
        judges.append(Judge(key, net, reference))
    if network.startswith("mnist-") and not any(j.key == "fd_judge" for j in judges):
        judges.append(
            Judge("fd_judge", load_digit_judge(device=device), load_reference(str(DIGIT_JUDGE_REFERENCE)))
        )
    return judges


class _Panel(FeatureNet):
    """The scoring network and the judges as one, so that every batch (perhaps sampled once) is embedded by all."""

    def __init__(self, net: FeatureNet, judges: list[Judge]):
        super().__init__()
        self.net, self.judges = net, nn.ModuleList(j.net for j in judges)
        self.keys = [j.key for j in judges]

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net.features(images_uint8)
        for key, judge in zip(self.keys, self.judges):
            out[f"{key}/pool"] = judge.features(images_uint8)["pool"]
        return out


def my_batches(num_images: int, batch_size: int, rank: int = 0, world: int = 1) -> list[range]:
    """This process's consecutive global batches: gathered in rank order they are the set, for any world."""
    num_batches = math.ceil(num_images / batch_size)
    return [
        range(b * batch_size, min((b + 1) * batch_size, num_images))
        for b in range(rank * num_batches // world, (rank + 1) * num_batches // world)
    ]


def shard_batches(
    source, batch_size: int, runtime: Runtime | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """This process's batches of ``source`` (``len`` and ``read(start, stop)``), as ``my_batches`` shares them."""
    rank, world = (runtime.rank, runtime.world) if runtime is not None else (0, 1)
    for batch in my_batches(len(source), batch_size, rank, world):
        yield source.read(batch.start, batch.stop)


def gather_features(local: dict[str, torch.Tensor], runtime: Runtime | None = None) -> dict[str, torch.Tensor]:
    """Every process's rows in rank order (every rank calls it); a key that some rank lacks is dropped."""
    if runtime is None or runtime.world == 1:
        return local
    shapes = runtime.gather_objects({k: (tuple(v.shape), v.dtype) for k, v in local.items()})
    present = [s for s in shapes if s]
    if not present:
        return {}
    counts = [next(iter(s.values()))[0][0] if s else 0 for s in shapes]
    device = runtime.device
    gathered = {}
    for key in sorted(set.intersection(*(set(s) for s in present))):
        shape, dtype = present[0][key]
        rows = local[key].to(device) if key in local else torch.empty((0, *shape[1:]), dtype=dtype, device=device)
        padded = rows.new_zeros((max(counts), *shape[1:]))
        padded[: len(rows)] = rows
        parts = runtime.all_gather(padded)
        gathered[key] = torch.cat([part[:n] for part, n in zip(parts, counts)])
    return gathered


@torch.no_grad()
def extract_features(net: FeatureNet, batches: Iterable) -> tuple[dict[str, torch.Tensor], float]:
    """This process's features of ``batches`` (``labels`` if all have them) and the seconds spent embedding."""
    device = next(net.parameters()).device
    parts: dict[str, list[torch.Tensor]] = {}
    labels: list[torch.Tensor | None] = []
    seconds = 0.0
    for item in batches:
        images, batch_labels = item if isinstance(item, (tuple, list)) else (item, None)
        start = time.perf_counter()
        for key, value in net(images.to(device)).items():
            parts.setdefault(key, []).append(value)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - start
        labels.append(None if batch_labels is None else torch.as_tensor(batch_labels))
    if not parts:
        return {}, seconds
    features = {key: torch.cat(values) for key, values in parts.items()}
    if labels and all(batch_labels is not None for batch_labels in labels):
        features["labels"] = torch.cat(labels).to(device=device, dtype=torch.int64)
    return features, seconds


def _check_dimensions(net: FeatureNet, ref: ReferenceStats) -> None:
    """Refuse at start-up a reference whose feature sizes are not the network's."""
    wrong = [
        f"{name} {array.shape[-1]} (the network's: {dim})"
        for name, array, dim in (
            ("mu", ref.mu, net.pool_dim),
            ("features", ref.features, net.pool_dim),
            ("mu_s", ref.mu_s, net.spatial_dim),
        )
        if array is not None and dim is not None and array.shape[-1] != dim
    ]
    if wrong:
        raise UserError(
            f"the reference's features do not have {net.name}'s sizes: {', '.join(wrong)}. Use the reference "
            "written with this network, or write one with python -m dit.eval ref."
        )


class Evaluator:
    """Scores image sets against one reference with its feature network, its judges and bootstrap intervals."""

    def __init__(
        self,
        feature_net: FeatureNet,
        reference: ReferenceStats,
        metrics: Iterable[str] | None = None,
        batch_size: int = 64,
        pr_batch_size: int = PR_BATCH_SIZE,
        runtime: Runtime | None = None,
        pr_distances: str = "float32",
        judges: Iterable[Judge] = (),
        bootstrap: int = BOOTSTRAP_RESAMPLES,
    ):
        self.judges = list(judges)
        for net, ref in ((feature_net, reference), *((j.net, j.reference) for j in self.judges)):
            if ref.feature_network != net.name:
                raise UserError(
                    f"the reference statistics were computed with {ref.feature_network}, the samples would be "
                    f"embedded with {net.name}: statistics of two networks cannot be compared. Use the weights "
                    "that made the reference, or write new statistics with python -m dit.eval ref."
                )
            _check_dimensions(net, ref)
        self.net, self.reference, self.runtime = feature_net, reference, runtime
        self.batch_size, self.pr_batch_size, self.pr_distances = batch_size, pr_batch_size, pr_distances
        self.bootstrap = bootstrap
        self.metrics = self._resolve(metrics)
        self.network_flops_per_image = feature_net.flops_per_image()
        self.judge_flops_per_image = sum(j.net.flops_per_image() for j in self.judges)
        self.flops_per_image = self.network_flops_per_image + self.judge_flops_per_image
        self._panel = _Panel(feature_net, self.judges) if self.judges else feature_net
        self._ref_pr: tuple[torch.Tensor, torch.Tensor] | None = None

    def _resolve(self, metrics: Iterable[str] | None) -> tuple[str, ...]:
        ref, net = self.reference, self.net
        available = {
            "fid": True,
            "sfid": net.spatial_dim is not None and ref.mu_s is not None,
            "is": net.num_classes > 0,
            "pr": ref.features is not None or ref.images is not None,
            "accuracy": net.labels_are_classes,
        }
        if metrics is None:
            return tuple(m for m in METRICS if available[m])
        metrics = tuple(metrics)
        unknown = [m for m in metrics if m not in available]
        if unknown:
            raise UserError(f"unknown metric(s) {', '.join(unknown)}: choose among {', '.join(METRICS)}.")
        missing = [m for m in metrics if not available[m]]
        if missing:
            why = {
                "sfid": "needs a network with spatial features (Inception) and a reference with mu_s/sigma_s",
                "pr": "needs a reference with pool features (written without --no-features) or images",
                "accuracy": f"needs a classifier whose classes are the sampled labels ({net.name} is not one)",
            }
            raise UserError("; ".join(f"{m} {why[m]}" for m in missing) + ".")
        return metrics

    def check_count(self, num_images: int) -> None:
        """Refuse, before any work, a set (or reference) too small for the covariances of the chosen metrics."""
        for metric, dim in (("fid", self.net.pool_dim), ("sfid", self.net.spatial_dim)):
            if metric in self.metrics:
                check_enough_images(num_images, dim, f"the sample set ({metric})")
                if self.reference.num_images is not None:
                    check_enough_images(self.reference.num_images, dim, f"the reference ({metric})")
        for judge in self.judges:
            check_enough_images(num_images, judge.net.pool_dim, f"the sample set ({judge.key})")

    def _reference_for_pr(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(features, radii, images embedded, FLOPs) of the reference, cached after the first call."""
        if self._ref_pr is not None:
            return (*self._ref_pr, 0, 0)
        device = next(self.net.parameters()).device
        embedded = 0
        if self.reference.features is not None:
            features = torch.from_numpy(self.reference.features).to(device=device, dtype=torch.float32)
        else:  # ADM's reference batch: its arr_0 images are the reference set
            local, _ = extract_features(
                self.net, shard_batches(self.reference.images, self.batch_size, self.runtime)
            )
            features = gather_features(local, self.runtime)["pool"]
            embedded = len(features)
        radii = knn_radii(features, PR_NEIGHBOURS, self.pr_batch_size, self.pr_distances)
        self._ref_pr = features, radii
        return features, radii, embedded, pairwise_flops(len(features), len(features), features.shape[1])

    def evaluate(self, batches: Iterable, keep_features: bool = False) -> dict:
        """Scores of this process's share of ``batches``; ``keep_features`` also returns each FD's features."""
        local, feature_seconds = extract_features(self._panel, batches)
        start = time.perf_counter()
        feats = gather_features(local, self.runtime)
        if not feats:
            raise UserError("no images to evaluate: the batches were empty.")
        n = len(feats["pool"])
        out = dict.fromkeys(SCORES)
        eps_used, intervals, kept = [], {}, {}
        flops = {"network": self.network_flops_per_image * n, "judges": self.judge_flops_per_image * n,
                 "precision_recall": 0}  # fmt: skip

        self.check_count(n)
        for key, metric, mu, sigma in (
            ("pool", "fid", self.reference.mu, self.reference.sigma),
            ("spatial", "sfid", self.reference.mu_s, self.reference.sigma_s),
            *((f"{j.key}/pool", j.key, j.reference.mu, j.reference.sigma) for j in self.judges),
        ):
            if metric in self.metrics or metric in JUDGE_SCORES:
                result = frechet_distance(*mean_cov(feats[key].double().cpu().numpy()), mu, sigma)
                out[metric] = result.value
                if keep_features and metric != "sfid":
                    kept[metric] = feats[key].float().cpu().numpy()
                if result.eps_used:
                    eps_used.append(metric)
                if self.bootstrap and metric != "sfid":  # sFID: 2023-d spatial features, a score of its own
                    interval = fd_interval(result.value, feats[key], mu, sigma, self.bootstrap)
                    intervals[metric] = [interval.low, interval.high]
        if "is" in self.metrics:
            out["inception_score"] = inception_score(feats["logits"])
        if "pr" in self.metrics:
            ref, ref_radii, embedded, ref_flops = self._reference_for_pr()
            samples = feats["pool"].float()
            radii = knn_radii(samples, PR_NEIGHBOURS, self.pr_batch_size, self.pr_distances)
            out["precision"], out["recall"] = precision_recall(
                ref, ref_radii, samples, radii, self.pr_batch_size, self.pr_distances
            )
            flops["network"] += self.network_flops_per_image * embedded
            flops["precision_recall"] = (
                ref_flops + pairwise_flops(n, n, samples.shape[1]) + pairwise_flops(len(ref), n, samples.shape[1])
            )
        if "accuracy" in self.metrics and "labels" in feats:
            out["class_accuracy"] = class_accuracy(feats["logits"], feats["labels"])
        return {
            **out,
            "num_images": n,
            "processes": self.runtime.world if self.runtime is not None else 1,
            "feature_network": self.net.name,
            "flops": sum(flops.values()),
            "flops_breakdown": flops,
            "seconds": feature_seconds + time.perf_counter() - start,  # producing the batches not included
            "sqrtm_eps_used": eps_used,
            "intervals": intervals,  # bootstrap intervals of the Fréchet distances, by score
            "bootstrap_resamples": self.bootstrap,
            **({"features": kept} if keep_features else {}),
        }
