"""``dit-cost`` / ``python -m dit.cost``: FLOPs, training and sampling budgets, memory, peaks and charts.

Readable tables by default, ``--json`` for machines. Flags shared with train.py and sample.py keep their
names there: --model, --image-size, --global-batch-size, --precision, --num-sampling-steps, --cfg-scale.
"""

from __future__ import annotations

import argparse
import json
import sys

from dit.cli import run_cli
from dit.cost import analytic, memory, peaks, plan
from dit.errors import UserError
from dit.model_config import MODEL_NAMES, describe


def _model_args(p: argparse.ArgumentParser, required_model: bool = False) -> None:
    g = p.add_argument_group("model (registry name, or a custom size)")
    g.add_argument("--model", required=required_model, help=f"one of {', '.join(MODEL_NAMES)}")
    g.add_argument("--image-size", type=int, default=256, help="pixels (latents are image/8 with the VAE)")
    g.add_argument("--latent-size", type=int, help="the model's input size, if not image-size / 8")
    g.add_argument("--in-channels", type=int, help="default 4 (VAE latents), or 3 with --no-vae")
    g.add_argument("--no-vae", action="store_true", help="pixel-space model: no VAE, input = image")
    g.add_argument("--num-classes", type=int, default=1000)
    g.add_argument("--no-learn-sigma", action="store_true", help="output C channels, not 2C")
    g.add_argument("--depth", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-heads", type=int)
    g.add_argument("--patch-size", type=int)


def _config(args, model: str | None = None):
    return plan.model_for_image(
        model if model is not None else args.model,
        args.image_size,
        vae=not args.no_vae,
        latent_size=args.latent_size,
        in_channels=args.in_channels,
        num_classes=args.num_classes,
        learn_sigma=False if args.no_learn_sigma else None,
        depth=args.depth,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        patch_size=args.patch_size,
    )


def _checkpointed(args, cfg) -> int:
    """--checkpointed-blocks N or "all"."""
    value = args.checkpointed_blocks
    blocks = cfg.depth if value == "all" else int(value) if str(value).isdigit() else -1
    if not 0 <= blocks <= cfg.depth:
        raise UserError(f"--checkpointed-blocks must be 'all' or 0..{cfg.depth} (the depth), got {value!r}.")
    return blocks


def _budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", help="device name or alias (H100-SXM, A100, 'NVIDIA L40S'); see `dit-cost peaks`")
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--precision", default="bf16", choices=peaks.PRECISIONS)
    p.add_argument("--mfu", type=float, help="model FLOPs utilisation in (0, 1], e.g. 0.4")
    p.add_argument("--calibration", help="calibration JSON from a benchmark (schema: docs/cost_model.md)")
    p.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s per device, overriding the table")
    p.add_argument("--price-per-hour", type=float, help="price of one device-hour, for the cost line")


def _budget_options(args) -> dict:
    return dict(
        device=args.gpu,
        precision=args.precision,
        mfu=args.mfu,
        calibration=args.calibration,
        price_per_device_hour=args.price_per_hour,
        peak_tflops=args.peak_tflops,
    )


def _print_table(rows: list[list], headers: list[str]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _print_pairs(pairs: list[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in pairs)
    for key, value in pairs:
        print(f"{key.ljust(width)}  {value}")


def _num(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}"


# ---- flops --------------------------------------------------------------------------------------------


def cmd_flops(args) -> None:
    names = MODEL_NAMES if args.all else [args.model]
    if not args.all and args.model is None and args.depth is None:
        raise UserError(
            f"pass --model (one of {', '.join(MODEL_NAMES)}), --all, or a custom --depth/--hidden-size/..."
        )
    summaries = []
    for name in names:
        cfg = _config(args, name)
        summary = analytic.flops_summary(cfg, args.image_size, _checkpointed(args, cfg))
        if args.measure:
            from dit.cost.measured import measure_flops

            measured = measure_flops(cfg, batch_size=1, checkpointed_blocks=summary["checkpointed_blocks"])
            summary["measured_forward_gflops"] = measured["forward_flops_per_image"] / 1e9
            summary["measured_train_gflops_per_image"] = measured["train_flops_per_image"] / 1e9
        if args.fvcore:
            from dit.cost.measured import fvcore_forward_macs

            handled, default = (fvcore_forward_macs(cfg, sdpa_handle=h) for h in (True, False))
            summary["fvcore_gmacs"] = handled["total"] / 1e9
            summary["fvcore_layer_norm_gmacs"] = handled["layer_norm"] / 1e9
            summary["fvcore_without_sdpa_handle_gmacs"] = default["total"] / 1e9
        summaries.append(summary)
    if args.json:
        print(json.dumps(summaries if args.all else summaries[0], indent=2))
    elif args.all:
        _print_table(
            [
                [
                    s["model"],
                    s["tokens"],
                    _num(s["params"] / 1e6, 1),
                    _num(s["forward_gmacs"], 3),
                    _num(s["forward_gflops"], 3),
                    _num(s["train_gflops_per_image"], 2),
                    _num(100 * s["attention_share"], 1),
                    f"+{100 * (s['six_nt_gflops_per_image'] / s['train_gflops_per_image'] - 1):.0f}%",
                ]
                + ([_num(s["measured_forward_gflops"] / s["forward_gflops"], 5)] if args.measure else [])
                for s in summaries
            ],
            ["model", "tokens", "params (M)", "fwd GMACs", "fwd GFLOPs", "train GFLOPs/img", "attn %", "6NT error"]
            + (["measured/analytic"] if args.measure else []),
        )
        print(
            f"\n{args.image_size} px; GMACs = the DiT paper's 'Gflops'; FLOPs = 2 x MACs; training = 3 x forward."
        )
    else:
        s = summaries[0]
        print(f"{s['description']}: {s['tokens']} tokens, {s['params']:,} parameters\n")
        _print_table(
            [
                [k, _num(v, 4), _num(2 * v, 4), _num(100 * v / s["forward_gmacs"], 2)]
                for k, v in s["components"].items()
            ],
            ["component", "GMACs", "GFLOPs", "%"],
        )
        pairs = [
            ("forward GMACs (paper 'Gflops')", _num(s["forward_gmacs"], 4)),
            ("forward GFLOPs", _num(s["forward_gflops"], 4)),
            ("training GFLOPs / image (3x)", _num(s["train_gflops_per_image"], 3)),
            (
                f"hardware GFLOPs / image ({s['checkpointed_blocks']} ckpt blocks, flash)",
                _num(s["hardware_gflops_per_image"], 3),
            ),
            (
                "6*N*T estimate (wrong for DiT)",
                f"{_num(s['six_nt_gflops_per_image'], 1)} "
                f"(+{100 * (s['six_nt_gflops_per_image'] / s['train_gflops_per_image'] - 1):.1f}%)",
            ),
        ]
        if args.measure:
            pairs.append(("FlopCounterMode on meta, forward GFLOPs", _num(s["measured_forward_gflops"], 4)))
            pairs.append(
                ("FlopCounterMode on meta, fwd+bwd GFLOPs", _num(s["measured_train_gflops_per_image"], 3))
            )
        if args.fvcore:
            fv, ln, bare = s["fvcore_gmacs"], s["fvcore_layer_norm_gmacs"], s["fvcore_without_sdpa_handle_gmacs"]
            pairs.append(
                (
                    "fvcore + SDPA handle, GMACs",
                    f"{_num(fv, 4)} (LayerNorm {_num(ln, 4)}; less LN {_num(fv - ln, 4)})",
                )
            )
            pairs.append(
                (
                    "fvcore as shipped (no SDPA), GMACs",
                    f"{_num(bare, 4)} ({100 * (bare / s['forward_gmacs'] - 1):+.1f}%)",
                )
            )
        print()
        _print_pairs(pairs)


# ---- train / sample -----------------------------------------------------------------------------------


def cmd_train(args) -> None:
    cfg = _config(args)
    result = plan.plan_training(
        cfg,
        args.image_size,
        args.global_batch_size,
        args.steps,
        args.num_gpus,
        **_budget_options(args),
        checkpointed_blocks=_checkpointed(args, cfg),
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return
    r = result
    pairs = [
        ("model", f"{r['description']} at {r['image_size']} px"),
        ("run", f"{r['steps']:,} steps x global batch {r['global_batch_size']} = {r['images']:,} images"),
        ("devices", f"{r['num_devices']} x {r['device']} ({r['batch_per_device']} images each)"),
        ("peak", f"{_num(r['peak_tflops_per_device'], 1)} TFLOP/s {r['precision']} ({r['peak_source']})"),
        ("MFU", f"{r['mfu']:.3f} ({r['mfu_source']})"),
        (
            "FLOPs / image",
            f"{_num(r['train_gflops_per_image'], 2)} GFLOP (3 x {_num(r['forward_gflops_per_image'], 2)})",
        ),
        ("total FLOPs", f"{r['total_flops']:.4e} FLOP = {r['total_macs']:.4e} MAC (paper 'flops')"),
        ("throughput", f"{_num(r['images_per_sec'], 1)} images/s"),
        ("device-hours", _num(r["device_hours"], 1)),
        ("wall-clock", f"{_num(r['days'], 3)} days ({_num(r['seconds'] / 3600, 2)} h)"),
    ]
    if r["cost"] is not None:
        pairs.append(("cost", f"{_num(r['cost'], 2)} at {r['price_per_device_hour']} per device-hour"))
    if "memory_gib_per_device" in r:
        cap = f" of {_num(r['device_memory_gib'], 0)} GiB" if r["device_memory_gib"] else ""
        pairs.append(
            ("memory / device", f"{_num(r['memory_gib_per_device'], 1)} GiB{cap} (analytic, AdamW + EMA)")
        )
    _print_pairs(pairs)


def cmd_sample(args) -> None:
    cfg = _config(args)
    result = plan.plan_sampling(
        cfg,
        args.image_size,
        args.num_images,
        args.num_sampling_steps,
        args.cfg_scale,
        args.num_gpus,
        **_budget_options(args),
        vae_config=None if args.no_vae else analytic.SD_VAE_CONFIG,
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return
    r = result
    pairs = [
        ("model", f"{describe(cfg)} at {r['image_size']} px"),
        (
            "per image",
            f"{r['num_sampling_steps']} steps x {r['forward_passes_per_image'] // r['num_sampling_steps']} passes "
            f"x {_num(r['forward_gflops'], 2)} GFLOP + VAE decode {_num(r['vae_decode_gflops_per_image'], 1)} "
            f"= {_num(r['gflops_per_image'] / 1e3, 2)} TFLOP",
        ),
        ("total FLOPs", f"{r['total_flops']:.4e} for {r['num_images']:,} images"),
        ("devices", f"{r['num_devices']} x {r['device']}, peak {_num(r['peak_tflops_per_device'], 1)} TFLOP/s"),
        ("MFU", f"{r['mfu']:.3f} ({r['mfu_source']}; VAE assumed at the same MFU)"),
        ("throughput", f"{_num(r['images_per_sec'], 2)} images/s"),
        ("wall-clock", f"{_num(r['seconds'] / 3600, 2)} h"),
        ("device-hours", _num(r["device_hours"], 2)),
    ]
    if r["cost"] is not None:
        pairs.append(("cost", f"{_num(r['cost'], 2)} at {r['price_per_device_hour']} per device-hour"))
    _print_pairs(pairs)


# ---- memory -------------------------------------------------------------------------------------------


def _device_memory(args) -> int | None:
    if args.memory_gib is not None:
        if not args.memory_gib > 0:
            raise UserError(f"--memory-gib must be positive, got {args.memory_gib}.")
        return int(args.memory_gib * 2**30)
    if args.gpu is None:
        return None
    capacity = peaks.device_memory_bytes(args.gpu)
    if capacity is None:
        raise UserError(f"memory of {args.gpu!r} is not known from its name: pass --memory-gib.")
    return capacity


def cmd_memory(args) -> None:
    cfg = _config(args)
    if args.batch_per_device is None and args.global_batch_size is None:
        raise UserError("pass --batch-per-device, or --global-batch-size with --num-gpus.")
    if args.num_gpus < 1:
        raise UserError(f"--num-gpus must be >= 1, got {args.num_gpus}.")
    batch = args.batch_per_device
    if batch is None:
        if args.global_batch_size % args.num_gpus:
            raise UserError(
                f"--global-batch-size {args.global_batch_size} does not split over {args.num_gpus} GPUs."
            )
        batch = args.global_batch_size // args.num_gpus
    options = dict(
        precision=args.precision,
        checkpointed_blocks=_checkpointed(args, cfg),
        ema=not args.no_ema,
        sharding=args.sharding,
        world_size=args.num_gpus,
    )
    estimate = memory.estimate_training_memory(cfg, batch, **options)
    result = {
        "model": describe(cfg),
        "batch_per_device": batch,
        **options,
        "estimate_bytes": estimate.total,
        "estimate_parts": estimate.parts,
        "peak_phase": estimate.phase,
    }
    if args.trace:
        if args.num_gpus > 1:
            raise UserError("--trace runs one device; drop --num-gpus (sharding is analytic only).")
        traced = memory.trace_training_memory(
            cfg, batch, args.precision, options["checkpointed_blocks"], ema=not args.no_ema
        )
        result["traced_bytes"] = traced.peak_bytes
        result["traced_parts"] = traced.at_peak
    capacity = _device_memory(args)
    if args.reserve_gib < 0:
        raise UserError(f"--reserve-gib must be >= 0, got {args.reserve_gib}.")
    if capacity is not None:
        usable = capacity - int(args.reserve_gib * 2**30)
        result["device_memory_bytes"] = capacity
        result["reserve_bytes"] = capacity - usable
        result["max_batch_per_device"] = memory.max_batch_that_fits(cfg, usable, **options) if usable > 0 else 0
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{result['model']}, batch {batch} per device, {args.precision}, {options['checkpointed_blocks']} "
        f"checkpointed blocks, {'EMA, ' if options['ema'] else ''}{args.sharding} x {args.num_gpus}\n"
    )
    _print_table([[k, _num(v / 2**30, 3)] for k, v in estimate.parts.items()], ["part", "GiB"])
    pairs = [("analytic peak", f"{_num(estimate.total / 2**30, 3)} GiB (at the {estimate.phase})")]
    if args.trace:
        ratio = estimate.total / result["traced_bytes"]
        pairs.append(
            (
                "traced peak (FakeTensor)",
                f"{_num(result['traced_bytes'] / 2**30, 3)} GiB (analytic/traced {ratio:.3f})",
            )
        )
    if capacity is not None:
        pairs.append(
            (
                "device memory",
                f"{_num(capacity / 2**30, 1)} GiB, {args.reserve_gib} GiB kept for context and allocator",
            )
        )
        pairs.append(("largest batch per device that fits", result["max_batch_per_device"]))
    print()
    _print_pairs(pairs)


# ---- peaks and plots ----------------------------------------------------------------------------------


def cmd_peaks(args) -> None:
    if args.device is not None:
        peak = peaks.resolve_peak(args.device, args.precision, args.peak_tflops)
        result = {
            "device": peak.device,
            "precision": peak.precision,
            "tflops": peak.flops / 1e12,
            "source": peak.source,
        }
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"{peak.device}: {_num(peak.flops / 1e12, 1)} TFLOP/s {peak.precision} ({peak.source})")
        return
    rows = [
        {"device": d.name, **{p: getattr(d, p) for p in peaks.PRECISIONS}, "memory_gib": d.memory_gib}
        for d in peaks.DEVICES
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    _print_table(
        [[r["device"], *("-" if r[k] is None else r[k] for k in (*peaks.PRECISIONS, "memory_gib"))] for r in rows],
        ["device", *(f"{p} TF" for p in peaks.PRECISIONS), "GiB"],
    )
    print(
        f"\nDense TFLOP/s per device (MI250X/MI250 per GCD, TPUs per chip); '-' = no such rate. Unknown devices "
        f"get a measured peak; override with --peak-tflops or {peaks.PEAK_ENV}."
    )


def cmd_plot(args) -> None:
    from dit.cost import plots

    if args.chart == "flops":
        print(plots.plot_flops_vs_params(args.out, args.image_size))
        return
    cfg = _config(args)
    traced = tuple(int(b) for b in args.traced_batches.split(",")) if args.traced_batches else ()
    print(plots.plot_memory_vs_batch(args.out, cfg, args.precision, _device_memory(args), traced_batches=traced))


# ---- parser -------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dit-cost", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("flops", help="analytic FLOPs per image, by component")
    _model_args(p)
    p.add_argument("--all", action="store_true", help="every registry config at --image-size")
    p.add_argument("--checkpointed-blocks", default="0", help="for hardware FLOPs: N or 'all'")
    p.add_argument("--measure", action="store_true", help="also count with FlopCounterMode on meta")
    p.add_argument("--fvcore", action="store_true", help="also count with fvcore (runs the model on CPU)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_flops)

    p = sub.add_parser("train", help="FLOPs, device-hours, days and cost of a training run")
    _model_args(p, required_model=False)
    _budget_args(p)
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--checkpointed-blocks", default="0", help="N or 'all' (memory and hardware FLOPs)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_train)

    p = sub.add_parser("sample", help="FLOPs, time and cost to sample N images")
    _model_args(p)
    _budget_args(p)
    p.add_argument("--num-images", type=int, default=50_000)
    p.add_argument("--num-sampling-steps", type=int, default=250)
    p.add_argument("--cfg-scale", type=float, default=1.5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_sample)

    p = sub.add_parser("memory", help="training memory per device: analytic, traced, largest batch")
    _model_args(p)
    p.add_argument("--batch-per-device", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--precision", default="bf16", choices=memory.MEMORY_PRECISIONS)
    p.add_argument("--checkpointed-blocks", default="0", help="N or 'all'")
    p.add_argument("--no-ema", action="store_true")
    p.add_argument("--sharding", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--trace", action="store_true", help="also trace one real step on fake tensors")
    p.add_argument("--gpu", help="device, for its memory and the largest batch that fits")
    p.add_argument("--memory-gib", type=float, help="device memory, if --gpu does not say")
    p.add_argument("--reserve-gib", type=float, default=2.0, help="kept back for CUDA context and fragmentation")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_memory)

    p = sub.add_parser("peaks", help="the peak table, or the peak for one device name ('cpu' measures)")
    p.add_argument("--device", help="a device name to resolve, e.g. 'NVIDIA H100 80GB HBM3' or cpu")
    p.add_argument("--precision", default="bf16", choices=peaks.PRECISIONS)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=cmd_peaks)

    p = sub.add_parser("plot", help="PNG charts: 'flops' (all configs) or 'memory' (one config vs batch)")
    p.add_argument("chart", choices=("flops", "memory"))
    p.add_argument("--out", required=True, help="PNG path")
    _model_args(p)
    p.add_argument("--precision", default="bf16", choices=memory.MEMORY_PRECISIONS)
    p.add_argument("--gpu")
    p.add_argument("--memory-gib", type=float)
    p.add_argument("--traced-batches", help="comma-separated batches to trace as points, e.g. 8,64")
    p.set_defaults(run=cmd_plot)
    return parser


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
