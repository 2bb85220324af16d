"""``dit-cost`` / ``python -m dit.cost``: FLOPs, training and sampling budgets, memory, peaks and charts.

Readable tables by default, ``--json`` for machines. Flags shared with train.py and sample.py keep their
names: --model, --image-size, --vae, --global-batch-size, --max-steps, --precision,
--activation-checkpointing, --num-sampling-steps, --guidance-scale (alias --cfg-scale).
"""

from __future__ import annotations

import json
import sys

from dit.cost import analytic, memory, peaks, plan
from dit.cost.args import (
    CostModelSection,
    FlopsArgs,
    HardwareSection,
    MemoryArgs,
    PeaksArgs,
    PlotArgs,
    QualityArgs,
    SampleArgs,
    SampleHardwareSection,
    TrainArgs,
    evaluations,
    plan_of,
    planned_guidance,
)
from dit.io.cli import run_cli
from dit.io.config import Face
from dit.io.errors import UserError
from dit.io.progress import duration
from dit.model.config import describe, model_names
from dit.model.repa_config import RepaEncoderSection, RepaSection
from dit.objectives.sampling_section import FidSamplingSection

# ---- output ---------------------------------------------------------------------------------------------


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


def _money(amount: float) -> str:
    return f"{amount:,.2f}" if amount >= 1 else f"{amount:.3g}"


def _budget_pairs(r: dict) -> list[tuple[str, object]]:
    if r["seconds"] is None:
        return [("time and cost", "pass --gpu and --mfu (or --calibration) for throughput, hours and price")]
    pairs = [
        ("devices", f"{r['num_devices']} x {r['device']}, peak {_num(r['peak_tflops_per_device'], 1)} TFLOP/s "
                    f"{r['precision']} ({r['peak_source']})"),
        ("MFU", f"{r['mfu']:.3f} ({r['mfu_source']})"),
        ("throughput", f"{_num(r['images_per_sec'], 2)} images/s"),
        ("device-hours", _num(r["device_hours"], 1)),
        ("wall-clock", f"{_num(r['days'], 3)} days ({_num(r['seconds'] / 3600, 2)} h)"),
    ]  # fmt: skip
    if r["cost"] is not None:
        pairs.append(("cost", f"{_num(r['cost'], 2)} at {r['price_per_device_hour']} per device-hour"))
    return pairs


def _emit(result, as_json: bool, pairs) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print_pairs(pairs(result))


# ---- commands -------------------------------------------------------------------------------------------


def cmd_flops(model: CostModelSection, args: FlopsArgs) -> None:
    m, o = model, args
    summaries = []
    for name in model_names() if o.all else [m.model]:
        cfg = m.config(name)
        fused = o.attention == "fused"
        summary = analytic.flops_summary(cfg, m.image_size, m.checkpointed(cfg, o.activation_checkpointing), fused)
        if o.measure:
            from dit.cost.measured import measure_flops

            measured = measure_flops(cfg, batch_size=1, checkpointed_blocks=summary["checkpointed_blocks"])
            summary["measured_forward_gflops"] = measured["forward_flops_per_image"] / 1e9
            summary["measured_train_gflops_per_image"] = measured["train_flops_per_image"] / 1e9
        if o.fvcore:
            from dit.cost.measured import fvcore_forward_macs

            handled, default = (fvcore_forward_macs(cfg, sdpa_handle=h) for h in (True, False))
            summary["fvcore_gmacs"] = handled["total"] / 1e9
            summary["fvcore_layer_norm_gmacs"] = handled["layer_norm"] / 1e9
            summary["fvcore_without_sdpa_handle_gmacs"] = default["total"] / 1e9
        summaries.append(summary)
    if o.json:
        print(json.dumps(summaries if o.all else summaries[0], indent=2))
    elif o.all:
        _print_table(
            [
                [s["model"], s["tokens"], _num(s["params"] / 1e6, 1), _num(s["forward_gmacs"], 3),
                 _num(s["forward_gflops"], 3), _num(s["train_gflops_per_image"], 2), _num(100 * s["attention_share"], 1),
                 f"{100 * (s['six_nt_gflops_per_image'] / s['train_gflops_per_image'] - 1):+.0f}%"]
                + ([_num(s["measured_forward_gflops"] / s["forward_gflops"], 5)] if o.measure else [])
                for s in summaries
            ],
            ["model", "tokens", "params (M)", "fwd GMACs", "fwd GFLOPs", "train GFLOPs/img", "attn %", "6NT error"]
            + (["measured/analytic"] if o.measure else []),
        )  # fmt: skip
        print(f"\n{m.image_size} px; GMACs = the DiT paper's 'Gflops'; FLOPs = 2 x MACs; training = 3 x forward.")
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
        six = s["six_nt_gflops_per_image"]
        pairs = [
            ("forward GMACs (paper 'Gflops')", _num(s["forward_gmacs"], 4)),
            ("forward GFLOPs", _num(s["forward_gflops"], 4)),
            ("training GFLOPs / image (3x)", _num(s["train_gflops_per_image"], 3)),
            (f"hardware GFLOPs / image ({s['checkpointed_blocks']} ckpt blocks, {s['hardware_attention']} attention)",
             _num(s["hardware_gflops_per_image"], 3)),
            ("6*N*T estimate (wrong for DiT)", f"{_num(six, 1)} (+{100 * (six / s['train_gflops_per_image'] - 1):.1f}%)"),
        ]  # fmt: skip
        if o.measure:
            pairs.append(("FlopCounterMode on meta, forward GFLOPs", _num(s["measured_forward_gflops"], 4)))
            pairs.append(
                ("FlopCounterMode on meta, fwd+bwd GFLOPs", _num(s["measured_train_gflops_per_image"], 3))
            )
        if o.fvcore:
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


def _repa_flops(encoder: RepaEncoderSection, repa: RepaSection, cfg):
    """REPA's auxiliary FLOPs for --repa-encoder (torch and timm imported only then), or None."""
    if not encoder.encoder:
        return None
    from dit.data.encoder import encoder_shape, resolve_input_size

    size = resolve_input_size(encoder.encoder, encoder.input_size, round(cfg.tokens**0.5))
    return analytic.repa_flops(encoder_shape(encoder.encoder, size), cfg, repa.projector_dim), size


def cmd_train(
    model: CostModelSection,
    hardware: HardwareSection,
    args: TrainArgs,
    repa_encoder: RepaEncoderSection,
    repa_section: RepaSection,
) -> None:
    m, h, o = model, hardware, args
    cfg = m.config()
    repa, repa_size = _repa_flops(repa_encoder, repa_section, cfg) or (None, None)
    result = plan.plan_training(
        cfg, m.image_size, o.global_batch_size, o.max_steps, h.num_gpus, **h.budget(),
        checkpointed_blocks=m.checkpointed(cfg, o.activation_checkpointing), vae_config=plan.vae_config_for(m.vae),
        repa=repa, repa_cached=o.repa_cached_features,
    )  # fmt: skip
    if repa is not None:
        result.update(repa_encoder=repa_encoder.encoder, repa_input_size=repa_size)
    if o.ema_profiles:
        count, each = memory.snapshot_disk(cfg, len(o.ema_profiles), o.max_steps, o.ema_snapshot_every)
        result.update(ema_snapshots=count, ema_snapshot_gib=each / 2**30, ema_snapshots_gib=count * each / 2**30)

    def pairs(r):
        out = [
            ("model", f"{r['description']} at {r['image_size']} px"),
            ("run", f"{r['steps']:,} steps x global batch {r['global_batch_size']} = {r['images']:,} images"),
            ("DiT / image", f"{_num(r['train_gflops_per_image'], 2)} GFLOP = {_num(r['train_gmacs_per_image'], 2)} GMAC "
                            f"(3 x forward {_num(r['forward_gflops_per_image'], 2)} GFLOP)"),
            ("DiT / step", f"{r['step_flops']:.4e} FLOP"),
            ("total FLOPs (DiT)", f"{r['total_flops']:.4e} FLOP = {r['total_macs']:.4e} MAC (paper 'flops')"),
        ]  # fmt: skip
        if r["vae_encode_gflops_per_image"] is not None:
            enc = r["vae_encode_gflops_per_image"]
            out.append(
                ("VAE encode", f"{_num(enc, 2)} GFLOP = {_num(enc / 2, 2)} GMAC per image: "
                 f"{r['vae_encode_flops_per_step']:.4e} FLOP per step and {r['vae_encode_total_flops_on_the_fly']:.4e} "
                 "in total if encoded on the fly; once per image view if pre-extracted (extract_features.py)")
            )  # fmt: skip
        if r["repa_encoder_forward_gflops_per_image"] is not None:
            enc, proj = r["repa_encoder_forward_gflops_per_image"], r["repa_projector_train_gflops_per_image"]
            where = "once per image view, at extraction" if r["repa_features_cached"] else "in every step"
            out.append(
                ("REPA (auxiliary)", f"{r['repa_encoder']} at {r['repa_input_size']} px forward {_num(enc, 2)} GFLOP "
                 f"per image ({where}) + projector {_num(proj, 2)} GFLOP (trained, 3x forward) = "
                 f"{_num(r['aux_gflops_per_image'], 2)} GFLOP per training image, {r['aux_share_of_dit']:.1%} of the "
                 f"DiT's; {r['aux_total_flops']:.4e} FLOP in total (time below counts it; mfu is the DiT's)")
            )  # fmt: skip
        out += _budget_pairs(r)
        if "ema_snapshots" in r:
            out.append(("post-hoc EMA snapshots", f"{r['ema_snapshots']:,} x {_num(r['ema_snapshot_gib'], 3)} GiB = "
                        f"{_num(r['ema_snapshots_gib'], 3)} GiB of disk, all kept (checkpoints/ema/)"))  # fmt: skip
        if "memory_gib_per_device" in r:
            cap = f" of {_num(r['device_memory_gib'], 0)} GiB" if r["device_memory_gib"] else ""
            out.append(("memory / device", f"{_num(r['memory_gib_per_device'], 1)} GiB{cap} (analytic, AdamW + EMA, "
                                           f"{r['batch_per_device']} images per device)"))  # fmt: skip
        return out

    _emit(result, o.json, pairs)


def cmd_sample(
    model: CostModelSection, hardware: SampleHardwareSection, sampling: FidSamplingSection, args: SampleArgs
) -> None:
    m, h, o = model, hardware, args
    cfg = m.config()
    guide = m.config(o.guide_model) if o.guide_model is not None else None
    vae = plan.vae_config_for(m.vae)
    schedule = plan_of(m, sampling, o.guide_model)
    nfe, unguided = evaluations(m, sampling, o, schedule)
    result = plan.plan_sampling(
        cfg,
        m.image_size,
        o.num_images,
        nfe,
        planned_guidance(m, sampling, o.guide_model),
        h.num_gpus,
        **h.budget(),
        vae_config=vae,
        unguided_nfe=unguided,
        path_drop=sampling.guidance_path_drop,
        guide=guide,
    )
    result.update(
        num_sampling_steps=sampling.num_sampling_steps,
        sampler=schedule.sampler,
        guidance_interval=list(sampling.guidance_interval) if sampling.guidance_interval else None,
        nfe=nfe,
        guided_nfe=nfe - unguided,
        unguided_nfe=unguided,
    )

    def pairs(r):
        guided = f" (guidance {r['guidance_scale']:g} doubles the batch)" if r["guided_nfe"] else " (no guidance)"
        if r["guidance_interval"]:
            guided += f", guided in [{r['guidance_interval'][0]:g}, {r['guidance_interval'][1]:g}]"
        passes = f"{r['forward_passes_per_image']} passes x {_num(r['forward_gflops'], 2)} GFLOP"
        if guide is not None:
            guided = (
                f" (autoguidance {r['guidance_scale']:g}: the second pass the guide's)"
                if r["guided_nfe"]
                else guided
            )
            passes = (f"{r['nfe']} passes x {_num(r['forward_gflops'], 2)} GFLOP + {r['guided_nfe']} guide passes x "
                      f"{_num(r['guide_forward_gflops'], 2)} GFLOP")  # fmt: skip
        out = [
            ("model", f"{describe(cfg)} at {r['image_size']} px"),
            *([("guide", describe(guide))] if guide is not None else []),
            ("DiT / image", f"{r['nfe']} network evaluations (NFE; {r['sampler']}, {r['num_sampling_steps']} steps): "
                            f"{r['guided_nfe']} guided x 2 passes + {r['unguided_nfe']} unguided x 1 pass{guided} = "
                            f"{passes} = "
                            f"{_num(r['model_gflops_per_image'] / 1e3, 4)} TFLOP = {_num(r['model_gmacs_per_image'] / 1e3, 4)} TMAC"),
        ]  # fmt: skip
        if vae is not None:
            out.append(("VAE decode / image", f"{_num(r['vae_decode_gflops_per_image'], 2)} GFLOP"))
        out += [
            ("total", f"{r['total_flops']:.4e} FLOP for {r['num_images']:,} images (DiT {r['total_model_flops']:.4e}, "
                      f"VAE {r['total_vae_flops']:.4e}) = {r['total_macs']:.4e} MAC"),
            *_budget_pairs(r),
        ]  # fmt: skip
        if r["seconds"] is not None and vae is not None:
            out.append(("note", "the VAE decode is assumed to run at the DiT's MFU"))
        return out

    _emit(result, o.json, pairs)


def _device_memory(gpu: str | None, memory_gib: float | None) -> int | None:
    if memory_gib is not None:
        if not memory_gib > 0:
            raise UserError(f"--memory-gib must be positive, got {memory_gib}.")
        return int(memory_gib * 2**30)
    if gpu is None:
        return None
    capacity = peaks.device_memory_bytes(gpu)
    if capacity is None:
        raise UserError(f"memory of {gpu!r} is not known from its name: pass --memory-gib.")
    return capacity


def cmd_memory(model: CostModelSection, args: MemoryArgs) -> None:
    m, o = model, args
    cfg = m.config()
    if o.batch_size is None and o.global_batch_size is None:
        raise UserError("pass --batch-per-device, or --global-batch-size with --num-gpus.")
    if o.num_gpus < 1:
        raise UserError(f"--num-gpus must be >= 1, got {o.num_gpus}.")
    batch = o.batch_size
    if batch is None:
        if o.global_batch_size % o.num_gpus:
            raise UserError(f"--global-batch-size {o.global_batch_size} does not split over {o.num_gpus} GPUs.")
        batch = o.global_batch_size // o.num_gpus
    r = plan.plan_memory(
        cfg, batch, o.precision, m.checkpointed(cfg, o.activation_checkpointing, allow_auto=True), o.ema, o.sharding,
        o.num_gpus, _device_memory(o.gpu, o.memory_gib), o.memory_reserve_gib, o.trace, len(o.ema_profiles or ()),
    )  # fmt: skip
    if o.json:
        print(json.dumps(r, indent=2))
        return
    print(
        f"{r['model']}, batch {batch} per device, {o.precision}, {r['checkpointed_blocks']} checkpointed blocks, "
        f"{'EMA, ' if o.ema else ''}{o.sharding} x {o.num_gpus}\n"
    )
    _print_table([[k, _num(v / 2**30, 3)] for k, v in r["estimate_parts"].items()], ["part", "GiB"])
    pairs = [("analytic peak", f"{_num(r['estimate_bytes'] / 2**30, 3)} GiB (at the {r['peak_phase']})")]
    if o.trace:
        ratio = r["estimate_bytes"] / r["traced_bytes"]
        pairs.append(
            ("traced peak (FakeTensor)", f"{_num(r['traced_bytes'] / 2**30, 3)} GiB (analytic/traced {ratio:.3f})")
        )
    if "device_memory_bytes" in r:
        pairs.append(("device memory", f"{_num(r['device_memory_bytes'] / 2**30, 1)} GiB, "
                                       f"{_num(r['reserve_bytes'] / 2**30, 1)} GiB kept for context and allocator"))  # fmt: skip
        pairs.append(("largest batch per device that fits", r["max_batch_per_device"]))
    print()
    _print_pairs(pairs)


def cmd_peaks(args: PeaksArgs) -> None:
    o = args
    if o.device is not None:
        from dit.runtime.precision import Precision  # an unknown device is measured: in the runtime's mode

        with Precision(o.precision, "cuda").flags():
            peak = peaks.resolve_peak(o.device, o.precision, o.peak_tflops)
        result = {
            "device": peak.device,
            "precision": peak.precision,
            "tflops": peak.flops / 1e12,
            "source": peak.source,
        }
        if peak.detail:
            result["detail"] = peak.detail
        if peak.measured_on:
            result["measured_on"] = peak.measured_on
        print(json.dumps(result, indent=2) if o.json else f"peak: {peak.describe()}")
        return
    rows = [
        {"device": d.name, **{p: getattr(d, p) for p in peaks.PRECISIONS}, "memory_gib": d.memory_gib}
        for d in peaks.DEVICES
    ]
    if o.json:
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


def cmd_plot(model: CostModelSection, args: PlotArgs) -> None:
    m, o = model, args
    from dit.cost import plots

    if o.chart == "flops":
        print(plots.plot_flops_vs_params(o.out, m.image_size))
        return
    if o.chart == "quality":
        if not o.runs:
            raise UserError(
                "dit-cost plot quality needs run folders: dit-cost plot quality RUN [RUN ...] --out FILE."
            )
        if o.labels and len(o.labels) != len(o.runs):
            raise UserError(f"--labels gives {len(o.labels)} labels for {len(o.runs)} runs: one per run.")
        print(plots.plot_quality(o.out, o.runs, o.labels))
        return
    traced = tuple(int(b) for b in o.traced_batches.split(",")) if o.traced_batches else ()
    print(
        plots.plot_memory_vs_batch(
            o.out, m.config(), o.precision, _device_memory(o.gpu, o.memory_gib), traced_batches=traced
        )
    )


def cmd_quality(args: QualityArgs) -> None:
    o = args
    from dit.cost.quality import compute_to_target

    if o.num_gpus < 1:
        raise UserError(f"--num-gpus must be >= 1, got {o.num_gpus}.")
    r = compute_to_target(o.run, o.target_fid, o.price_per_hour)
    if o.gpu is not None or o.mfu is not None:
        if o.gpu is None or o.mfu is None or not 0 < o.mfu <= 1:
            raise UserError("a time on another device needs --gpu and --mfu in (0, 1].")
        peak = peaks.table_peak(o.gpu, o.precision)
        r["planned"] = None
        if r["reached"]:
            seconds = r["total_model_flops"] / (o.num_gpus * peak.flops * o.mfu)
            hours = seconds * o.num_gpus / 3600
            r["planned"] = {"device": peak.device, "num_devices": o.num_gpus, "mfu": o.mfu, "seconds": seconds,
                            "device_hours": hours,
                            "cost": hours * o.price_per_hour if o.price_per_hour is not None else None}  # fmt: skip
    if o.json:
        print(json.dumps(r, indent=2))
        return
    points = ", ".join(f"{e['fid']:.4g} at {e['total_model_pflops'] * 1e15:.3e}" for e in r["evaluations"])
    pairs = [("run", r["run"]), ("evaluations (FID at FLOPs)", points)]
    if not r["reached"]:
        pairs.append(("target", f"FID {o.target_fid:g} not reached (best {r['best_fid']:.4g})"))
    else:
        cost = (
            f", {_money(r['cost'])} at {r['price_per_device_hour']}/device-hour" if r["cost"] is not None else ""
        )
        pairs += [
            ("target", f"FID {o.target_fid:g} at step {r['step']:,.0f}"
                       + (" (the first evaluation: an upper bound)" if r["upper_bound"] else "")),
            ("training compute", f"{r['total_model_flops']:.4e} FLOP = {r['total_model_flops'] / 2:.4e} MAC"),
            ("measured", f"{duration(r['training_seconds'])} on {r['devices']} device(s) = "
                         f"{r['device_hours']:.4g} device-hours{cost}"),
        ]  # fmt: skip
        if r.get("planned"):
            p = r["planned"]
            planned_cost = f", {_money(p['cost'])}" if p["cost"] is not None else ""
            pairs.append(("planned", f"{duration(p['seconds'])} on {p['num_devices']} x {p['device']} at MFU "
                                     f"{p['mfu']:g} = {p['device_hours']:.4g} device-hours{planned_cost}"))  # fmt: skip
    _print_pairs(pairs)


# Each command: its function and the sections it reads (train.py's, where the thing is the same).
COMMANDS = {
    "flops": (cmd_flops, {"model": CostModelSection, "args": FlopsArgs}),
    "train": (cmd_train, {"model": CostModelSection, "hardware": HardwareSection, "args": TrainArgs,
                          "repa_encoder": (RepaEncoderSection, "repa_"), "repa_section": (RepaSection, "repa_")}),
    "sample": (cmd_sample, {"model": CostModelSection, "hardware": SampleHardwareSection,
                            "sampling": FidSamplingSection, "args": SampleArgs}),
    "memory": (cmd_memory, {"model": CostModelSection, "args": MemoryArgs}),
    "peaks": (cmd_peaks, {"args": PeaksArgs}),
    "plot": (cmd_plot, {"model": CostModelSection, "args": PlotArgs}),
    "quality": (cmd_quality, {"args": QualityArgs}),
}  # fmt: skip
FACE = Face(
    "dit-cost",
    __doc__.split("\n")[0],
    commands={name: Face(f"dit-cost {name}", (sections["args"].__doc__ or "").strip(), sections=sections,
                         outputs={"out": "file"} if name == "plot" else None,
                         inputs={"vae": "file"} if name == "plot" else None)
              for name, (_, sections) in COMMANDS.items()},
)  # fmt: skip


def _main(argv: list[str] | None) -> int:
    parsed = FACE.parse(argv)
    COMMANDS[parsed.command][0](**parsed.sections)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
