"""Score a sample set, or write reference statistics.

python -m dit.eval --samples SET.npz --ref VIRTUAL_imagenet256_labeled.npz [--json]
python -m dit.eval --samples FOLDER --ref REF.npz --inception-weights weights-inception-2015-12-05-6726825d.pth
python -m dit.eval ref --npz SET.npz --feature-net mnist --out REF.npz      (or --images FOLDER, --latents STORE)
python -m dit.eval ref --adm VIRTUAL_imagenet256_labeled.npz --out REF.npz  (ADM's statistics + arr_0 features)
python -m dit.eval --samples SET.npz --ref REF.npz --judge-ref DINO_REF.npz --dinov2-weights FILE  (+ FD_DINOv2)

The feature network is the one the reference was made with. Under torchrun every process embeds a slice of
the set and rank 0 prints (or writes) the result, equal to a single process's."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from dit.eval.digit_nets import DigitFeatures
from dit.eval.evaluator import METRICS, Evaluator, extract_features, gather_features, judges_for, shard_batches
from dit.eval.features import FEATURE_NETS, feature_net_for, load_feature_net
from dit.eval.inception import INCEPTION_NAME
from dit.eval.metrics import BOOTSTRAP_LEVEL, BOOTSTRAP_RESAMPLES, PR_DISTANCES, min_images_for_covariance
from dit.eval.reference import ReferenceStats, load_reference, save_stats, stats_from_features
from dit.eval.sources import LatentStoreImages, NpzImages, open_images
from dit.io.cli import exit_process, run_cli
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.io.face import Face
from dit.runtime import Runtime

DEFAULT_BATCH = {"inception": 64, "mnist": 500, "dinov2": 64, "digit-judge": 500}
WEIGHTS_HELP = "Inception-v3 weights file (offline); default: torch-fidelity's download"
DINOV2_HELP = "DINOv2 ViT-L/14 weights file (timm's vit_large_patch14_dinov2.lvd142m or Meta's .pth) for FD_DINOv2"
BATCH_HELP = "images per forward pass (default: 64 Inception, 500 digits)"


@dataclass(frozen=True)
class EvalConfig(Section):
    """python -m dit.eval: FID, sFID, IS, precision/recall (and class accuracy) of a sample set."""

    samples: str = option(help=".npz (arr_0 uint8 NHWC, optional arr_1 labels) or image folder")
    ref: str = option(help="our statistics (python -m dit.eval ref) or an ADM reference batch")
    json: bool = option(False, "print the result as one JSON object")
    metrics: str | None = option(None, f"comma-separated subset of {','.join(METRICS)} (default: all that apply)")
    image_size: int | None = option(None, "centre-crop a folder's images to this size")
    pr_batch_size: int = option(10_000, "rows per distance block of precision/recall (ADM: 10,000)", ge=1)
    pr_distances: str = option(
        "float32", "precision/recall distances: float32, or float16 as ADM's evaluator computes them (to match "
        "published numbers; docs/evaluation.md gives the difference)", choices=PR_DISTANCES,
    )  # fmt: skip
    inception_weights: str | None = option(None, WEIGHTS_HELP)
    judge_ref: str | None = option(
        None, "a second judge's statistics (ref --feature-net dinov2 or digit-judge): its FD is printed beside FID"
    )
    dinov2_weights: str | None = option(None, DINOV2_HELP)
    bootstrap: int = option(
        BOOTSTRAP_RESAMPLES, "bootstrap resamples for the FID/FD intervals (0: none; at 2048-d about 1 s each on a "
        "CPU)", ge=0,
    )  # fmt: skip
    batch_size: int | None = option(None, BATCH_HELP, ge=1)
    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda when available)")


@dataclass(frozen=True)
class RefConfig(Section):
    """python -m dit.eval ref: reference statistics from images, a sample set, a latent store or ADM's batch."""

    out: str = option(help="statistics file to write (.npz)")
    images: str | None = option(None, "a folder of images (recursively)")
    npz: str | None = option(None, "a sample set: arr_0 uint8 (N, H, W, 3)")
    latents: str | None = option(None, "a latent store, decoded through its VAE (posterior mean, no flip)")
    adm: str | None = option(None, "an ADM reference batch: keep its statistics, add its arr_0 pool features")
    feature_net: str = option("inception", "the network", choices=FEATURE_NETS)
    image_size: int | None = option(None, "centre-crop a folder's images to this size")
    vae: str | None = option(None, "for --latents: the VAE (default: the one the store records)")
    features: bool = option(True, "keep the pool features for precision/recall (--no-features: mu and sigma only)")
    inception_weights: str | None = option(None, WEIGHTS_HELP)
    dinov2_weights: str | None = option(None, DINOV2_HELP)
    batch_size: int | None = option(None, BATCH_HELP, ge=1)
    device: str | None = option(None, "cpu, cuda or cuda:N (default: cuda when available)")

    def check(self) -> None:
        given = [f"{{{k}}}" for k in ("images", "npz", "latents", "adm") if getattr(self, k)]
        if len(given) != 1:
            raise FieldError(
                "pass exactly one source of reference images: {images}, {npz}, {latents} or {adm}"
                + (f" (got {', '.join(given)})." if given else ".")
            )
        if self.adm and self.feature_net != "inception":
            raise FieldError("{adm} statistics are Inception-v3 statistics: leave {feature_net} at inception.")


REF_FACE = Face(
    "python -m dit.eval ref", RefConfig.__doc__, sections={"ref": RefConfig}, outputs={"out": "file"},
    inputs={"images": "folder", "npz": "file", "latents": "folder", "adm": "file", "vae": "file",
            "inception_weights": "file"},
)  # fmt: skip
FACE = Face("python -m dit.eval", __doc__, sections={"eval": EvalConfig})


def _format(result: dict, wall: float) -> str:
    lines = []
    intervals = result["intervals"]
    for key, label, fmt in (
        ("fid", "FID", "{:.4f}"),
        ("fd_dinov2", "FD_DINOv2", "{:.4f}"),
        ("fd_judge", "digit judge FD", "{:.4g}"),
        ("sfid", "sFID", "{:.4f}"),
        ("inception_score", "IS", "{:.4f}"),
        ("precision", "precision", "{:.4f}"),
        ("recall", "recall", "{:.4f}"),
        ("class_accuracy", "class accuracy", "{:.2%}"),
    ):
        if result[key] is not None:
            interval = " [{}, {}]".format(*map(fmt.format, intervals[key])) if key in intervals else ""
            lines.append(f"{label:<15}{fmt.format(result[key])}{interval}")
    if intervals:
        lines.append(
            f"{'intervals':<15}{BOOTSTRAP_LEVEL:.0%} bootstrap over the samples, {result['bootstrap_resamples']} "
            "resamples (docs/evaluation.md)"
        )
    flops = result["flops_breakdown"]
    lines += [
        f"{'images':<15}{result['num_images']:,}",
        f"{'labels':<15}{result['labels'] or 'not recorded'}",
        f"{'network':<15}{result['feature_network']}",
        f"{'wall time':<15}{wall:.2f} s (evaluation {result['seconds']:.2f} s, reading the images excluded)",
        f"{'FLOPs':<15}{result['flops']:.4g} (network {flops['network']:.4g}, judges {flops['judges']:.4g}, "
        f"precision/recall {flops['precision_recall']:.4g})",
    ]
    for metric in result["sqrtm_eps_used"]:
        lines.append(
            f"note: sqrtm(Σ1 Σ2) was not finite for {metric}; ADM's fallback added 1e-6·I to both covariances."
        )
    return "\n".join(lines)


def evaluate_main(argv: list[str]) -> int:
    args = FACE.parse(argv).sections["eval"]
    start = time.perf_counter()
    reference = load_reference(args.ref)
    samples = open_images(args.samples, args.image_size)
    with Runtime(args.device) as runtime:
        net = feature_net_for(reference.feature_network, args.inception_weights, runtime.device)
        judges = judges_for(reference.feature_network, args.judge_ref, args.dinov2_weights, runtime.device)
        batch = args.batch_size or DEFAULT_BATCH["mnist" if isinstance(net, DigitFeatures) else "inception"]
        metrics = args.metrics.split(",") if args.metrics else None
        evaluator = Evaluator(
            net, reference, metrics, batch, args.pr_batch_size, runtime, args.pr_distances, judges, args.bootstrap
        )
        evaluator.check_count(len(samples))
        if args.metrics and "accuracy" in evaluator.metrics and samples.labels is None:
            raise UserError(f"accuracy needs the sampled labels: {args.samples} has none (arr_1 in a .npz set).")
        result = evaluator.evaluate(shard_batches(samples, evaluator.batch_size, runtime))
    result["labels"] = samples.label_mode  # balanced or random: a score is read with its set's label mode
    result["wall_seconds"] = time.perf_counter() - start
    if runtime.is_main:
        print(json.dumps(result, indent=1) if args.json else _format(result, result["wall_seconds"]))
    return 0


def _ref_source(args: RefConfig, device) -> tuple[object, ReferenceStats | None]:
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
    args = REF_FACE.parse(argv).sections["ref"]
    with Runtime(args.device) as runtime:
        images, adm = _ref_source(args, runtime.device)
        net = load_feature_net(args.feature_net, args.inception_weights, runtime.device, args.dinov2_weights)
        if adm is not None and net.name != INCEPTION_NAME:
            raise UserError(
                f"ADM's statistics come from {INCEPTION_NAME}, but these weights are {net.name}: pass "
                "--inception-weights weights-inception-2015-12-05-6726825d.pth."
            )
        batch_size = args.batch_size if args.batch_size is not None else DEFAULT_BATCH[args.feature_net]
        local, _ = extract_features(net, shard_batches(images, batch_size, runtime))
        features = gather_features(local, runtime)
    if not features:
        raise UserError("no images to make statistics from.")
    if not runtime.is_main:
        return 0
    if adm is None:
        stats = stats_from_features(features, net.name, images.describe(), keep_features=args.features)
    else:  # ADM's mu/sigma cover the whole data set; only the precision/recall features come from arr_0
        pool = features["pool"].float().cpu().numpy() if args.features else None
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
    exit_process(run_cli(main))
