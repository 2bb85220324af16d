"""Score a sample set, or write reference statistics.

python -m dit.eval --samples SET.npz --ref VIRTUAL_imagenet256_labeled.npz [--json]
python -m dit.eval --samples FOLDER --ref REF.npz --inception-weights weights-inception-2015-12-05-6726825d.pth
python -m dit.eval ref --npz SET.npz --feature-net mnist --out REF.npz      (or --images FOLDER, --latents STORE)
python -m dit.eval ref --adm VIRTUAL_imagenet256_labeled.npz --out REF.npz  (ADM's statistics + arr_0 features)

The feature network is the one the reference was made with. Under torchrun every process embeds a slice of
the set and rank 0 prints (or writes) the result, equal to a single process's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from dit.cli import run_cli
from dit.errors import UserError
from dit.eval.evaluator import METRICS, Evaluator, extract_features, gather_features, shard_batches
from dit.eval.features import FEATURE_NETS, INCEPTION_NAME, FeatureNet, load_feature_net
from dit.eval.metrics import min_images_for_covariance
from dit.eval.reference import ReferenceStats, load_reference, save_stats, stats_from_features
from dit.eval.sources import LatentStoreImages, NpzImages, open_images

DEFAULT_BATCH = {"inception": 64, "mnist": 500}


@contextmanager
def process_group(device: str | None) -> Iterator[torch.device]:
    """Join torchrun's process group if there is one (NCCL on GPUs, gloo on CPU); this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and device != "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = torch.device(
        f"cuda:{local_rank}" if use_cuda and world > 1 else device or ("cuda" if use_cuda else "cpu")
    )
    if world == 1:
        yield resolved
        return
    if use_cuda:
        torch.cuda.set_device(resolved)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        yield resolved
    finally:
        dist.destroy_process_group()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _net_kind(network: str) -> str:
    return "mnist" if network.startswith("mnist-") else "inception"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--inception-weights", metavar="FILE", help="Inception-v3 weights (offline); default: download")
    p.add_argument("--batch-size", type=int, help="images per forward pass (default: 64 Inception, 500 digits)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")


def _format(result: dict, wall: float) -> str:
    lines = []
    for key, label, fmt in (
        ("fid", "FID", "{:.4f}"),
        ("sfid", "sFID", "{:.4f}"),
        ("inception_score", "IS", "{:.4f}"),
        ("precision", "precision", "{:.4f}"),
        ("recall", "recall", "{:.4f}"),
        ("class_accuracy", "class accuracy", "{:.2%}"),
    ):
        if result[key] is not None:
            lines.append(f"{label:<15}{fmt.format(result[key])}")
    flops = result["flops_breakdown"]
    lines += [
        f"{'images':<15}{result['num_images']:,}",
        f"{'network':<15}{result['feature_network']}",
        f"{'wall time':<15}{wall:.2f} s (evaluation {result['seconds']:.2f} s, reading the images excluded)",
        f"{'FLOPs':<15}{result['flops']:.4g} (network {flops['network']:.4g}, precision/recall "
        f"{flops['precision_recall']:.4g})",
    ]
    for metric in result["sqrtm_eps_used"]:
        lines.append(
            f"note: sqrtm(Σ1 Σ2) was not finite for {metric}; ADM's fallback added 1e-6·I to both covariances."
        )
    return "\n".join(lines)


def evaluate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dit.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--samples", required=True, help=".npz (arr_0 uint8 NHWC, optional arr_1 labels) or image folder"
    )
    p.add_argument(
        "--ref", required=True, help="our statistics (python -m dit.eval ref) or an ADM reference batch"
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--metrics", help=f"comma-separated subset of {','.join(METRICS)} (default: all that apply)")
    p.add_argument("--image-size", type=int, help="centre-crop a folder's images to this size")
    p.add_argument("--pr-batch-size", type=int, default=10_000, help="rows per distance block (ADM: 10,000)")
    _add_common(p)
    args = p.parse_args(argv)
    start = time.perf_counter()
    reference = load_reference(args.ref)
    samples = open_images(args.samples, args.image_size)
    kind = _net_kind(reference.feature_network)
    with process_group(args.device) as device:
        net = load_feature_net(kind, args.inception_weights, device)
        evaluator = Evaluator(
            net,
            reference,
            metrics=args.metrics.split(",") if args.metrics else None,
            batch_size=args.batch_size or DEFAULT_BATCH[kind],
            pr_batch_size=args.pr_batch_size,
        )
        evaluator.check_count(len(samples))
        result = evaluator.evaluate(shard_batches(samples, evaluator.batch_size))
        rank = _rank()
    result["wall_seconds"] = time.perf_counter() - start
    if rank == 0:
        print(json.dumps(result, indent=1) if args.json else _format(result, result["wall_seconds"]))
    return 0


def _ref_source(args, device: torch.device) -> tuple[object, ReferenceStats | None]:
    """The images to embed, and for --adm the ADM statistics to keep."""
    if args.adm:
        adm = load_reference(args.adm)
        if adm.images is None or adm.feature_network != INCEPTION_NAME or adm.num_images is not None:
            raise UserError(f"--adm {args.adm} is not an ADM reference batch (mu, sigma and arr_0 images).")
        return adm.images, adm
    if args.latents:
        return LatentStoreImages(args.latents, args.vae, device), None
    if args.npz:
        return NpzImages(args.npz), None
    return open_images(args.images, args.image_size), None


def ref_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dit.eval ref", description="Write reference statistics.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", help="a folder of images (recursively)")
    source.add_argument("--npz", help="a sample set: arr_0 uint8 (N, H, W, 3)")
    source.add_argument("--latents", help="a latent store, decoded through its VAE (posterior mean, no flip)")
    source.add_argument("--adm", help="an ADM reference batch: keep its statistics, add its arr_0 pool features")
    p.add_argument("--out", required=True, help="statistics file to write (.npz)")
    p.add_argument("--feature-net", choices=FEATURE_NETS, default="inception")
    p.add_argument("--image-size", type=int, help="centre-crop a folder's images to this size")
    p.add_argument("--vae", help="for --latents: the VAE (default: the one the store records)")
    p.add_argument(
        "--no-features", action="store_true", help="keep only mu and sigma (no precision/recall against it)"
    )
    _add_common(p)
    args = p.parse_args(argv)
    if args.adm and args.feature_net != "inception":
        raise UserError("--adm statistics are Inception-v3 statistics: leave --feature-net at inception.")
    with process_group(args.device) as device:
        images, adm = _ref_source(args, device)
        net: FeatureNet = load_feature_net(args.feature_net, args.inception_weights, device)
        if adm is not None and net.name != INCEPTION_NAME:
            raise UserError(
                f"ADM's statistics come from {INCEPTION_NAME}, but these weights are {net.name}: pass "
                "--inception-weights weights-inception-2015-12-05-6726825d.pth."
            )
        batches = shard_batches(images, args.batch_size or DEFAULT_BATCH[args.feature_net])
        local, _ = extract_features(net, batches)
        features = gather_features(local)
        rank = _rank()
    if not features:
        raise UserError("no images to make statistics from.")
    if rank != 0:
        return 0
    if adm is None:
        stats = stats_from_features(features, net.name, images.describe(), keep_features=not args.no_features)
    else:  # ADM's mu/sigma cover the whole data set; only the precision/recall features come from arr_0
        pool = None if args.no_features else features["pool"].float().cpu().numpy()
        stats = ReferenceStats(net.name, adm.mu, adm.sigma, None, pool, adm.mu_s, adm.sigma_s, adm.source)
    save_stats(args.out, stats)
    print(f"wrote {args.out}: {stats.source}, network {net.name}")
    need = min_images_for_covariance(net.pool_dim)
    if stats.num_images is not None and stats.num_images < need:
        print(f"note: {stats.num_images} images; FID against these statistics needs at least {need}.")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return ref_main(argv[1:]) if argv[:1] == ["ref"] else evaluate_main(argv)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
