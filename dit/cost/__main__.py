"""``dit-cost`` / ``python -m dit.cost``: FLOPs, training and sampling budgets, memory, peaks and charts."""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import replace

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
    sample_evaluations,
)
from dit.cost.devices import DEVICES, PRECISIONS, device_memory_bytes
from dit.cost.report import EmaSnapshots, Evaluations, RepaUse, num, print_pairs, print_table, show
from dit.io.cli import run_cli
from dit.io.errors import UserError
from dit.io.face import Face
from dit.io.progress import duration
from dit.model.config import model_names
from dit.model.repa_config import RepaEncoderSection, RepaSection
from dit.objectives.sampling_section import FidSamplingSection


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
        print_table(
            [
                [s["model"], s["tokens"], num(s["params"] / 1e6, 1), num(s["forward_gmacs"], 3),
                 num(s["forward_gflops"], 3), num(s["train_gflops_per_image"], 2), num(100 * s["attention_share"], 1),
                 f"{100 * (s['six_nt_gflops_per_image'] / s['train_gflops_per_image'] - 1):+.0f}%"]
                + ([num(s["measured_forward_gflops"] / s["forward_gflops"], 5)] if o.measure else [])
                for s in summaries
            ],
            ["model", "tokens", "params (M)", "fwd GMACs", "fwd GFLOPs", "train GFLOPs/img", "attn %", "6NT error"]
            + (["measured/analytic"] if o.measure else []),
        )  # fmt: skip
        print(f"\n{m.image_size} px; GMACs = the DiT paper's 'Gflops'; FLOPs = 2 x MACs; training = 3 x forward.")
    else:
        s = summaries[0]
        print(f"{s['description']}: {s['tokens']} tokens, {s['params']:,} parameters\n")
        fwd = s["forward_gmacs"]
        rows = [[k, num(v, 4), num(2 * v, 4), num(100 * v / fwd, 2)] for k, v in s["components"].items()]
        print_table(rows, ["component", "GMACs", "GFLOPs", "%"])
        six = s["six_nt_gflops_per_image"]
        pairs = [
            ("forward GMACs (paper 'Gflops')", num(s["forward_gmacs"], 4)),
            ("forward GFLOPs", num(s["forward_gflops"], 4)),
            ("training GFLOPs / image (3x)", num(s["train_gflops_per_image"], 3)),
            (f"hardware GFLOPs / image ({s['checkpointed_blocks']} ckpt blocks, {s['hardware_attention']} attention)",
             num(s["hardware_gflops_per_image"], 3)),
            ("6*N*T estimate (wrong for DiT)", f"{num(six, 1)} (+{100 * (six / s['train_gflops_per_image'] - 1):.1f}%)"),
        ]  # fmt: skip
        if o.measure:
            pairs.append(("FlopCounterMode on meta, forward GFLOPs", num(s["measured_forward_gflops"], 4)))
            pairs.append(("FlopCounterMode on meta, fwd+bwd GFLOPs", num(s["measured_train_gflops_per_image"], 3)))
        if o.fvcore:
            fv, ln, bare = s["fvcore_gmacs"], s["fvcore_layer_norm_gmacs"], s["fvcore_without_sdpa_handle_gmacs"]
            less, shipped = num(fv - ln, 4), 100 * (bare / s["forward_gmacs"] - 1)
            pairs.append(("fvcore + SDPA handle, GMACs", f"{num(fv, 4)} (LayerNorm {num(ln, 4)}; less LN {less})"))
            pairs.append(("fvcore as shipped (no SDPA), GMACs", f"{num(bare, 4)} ({shipped:+.1f}%)"))
        print()
        print_pairs(pairs)


def cmd_train(
    model: CostModelSection,
    hardware: HardwareSection,
    args: TrainArgs,
    repa_encoder: RepaEncoderSection,
    repa_section: RepaSection,
) -> None:
    m, h, o = model, hardware, args
    cfg = m.config()
    repa = None
    if repa_encoder.encoder:  # torch and timm imported only then
        from dit.data.encoder import encoder_shape, resolve_input_size

        size = resolve_input_size(repa_encoder.encoder, repa_encoder.input_size, round(cfg.tokens**0.5))
        repa = analytic.repa_flops(encoder_shape(repa_encoder.encoder, size), cfg, repa_section.projector_dim)
    result = plan.plan_training(
        cfg, m.image_size, o.global_batch_size, o.max_steps, h.budget(),
        checkpointed_blocks=m.checkpointed(cfg, o.activation_checkpointing), vae_config=plan.vae_config_for(m.vae),
        repa=repa, repa_cached=o.repa_cached_features,
    )  # fmt: skip
    if repa is not None:
        result = replace(result, repa=RepaUse(repa_encoder.encoder, size))
    if o.ema_profiles:
        count, each = memory.snapshot_disk(cfg, len(o.ema_profiles), o.max_steps, o.ema_snapshot_every)
        result = replace(result, ema=EmaSnapshots(count, each / 2**30, count * each / 2**30))
    show(result, o.json)


def cmd_sample(
    model: CostModelSection, hardware: SampleHardwareSection, sampling: FidSamplingSection, args: SampleArgs
) -> None:
    m, h, o = model, hardware, args
    cfg = m.config()
    guide = m.config(o.guide_model) if o.guide_model is not None else None
    schedule, guidance, nfe, unguided = sample_evaluations(cfg, sampling, o)
    result = plan.plan_sampling(
        cfg, m.image_size, o.num_images, nfe, guidance, h.budget(), vae_config=plan.vae_config_for(m.vae),
        unguided_nfe=unguided, path_drop=sampling.guidance_path_drop, guide=guide,
    )  # fmt: skip
    interval = list(sampling.guidance_interval) if sampling.guidance_interval else None
    evals = Evaluations(schedule.sampler, interval, nfe, nfe - unguided, unguided)
    show(replace(result, num_sampling_steps=sampling.num_sampling_steps, evaluations=evals), o.json)


def _device_memory(gpu: str | None, memory_gib: float | None) -> int | None:
    if memory_gib is not None:
        return int(memory_gib * 2**30)
    if gpu is None:
        return None
    capacity = device_memory_bytes(gpu)
    if capacity is None:
        raise UserError(f"memory of {gpu!r} is not known from its name: pass --memory-gib.")
    return capacity


def cmd_memory(model: CostModelSection, args: MemoryArgs) -> None:
    m, o = model, args
    cfg = m.config()
    r = plan.plan_memory(
        cfg, o.batch_per_device, o.precision, m.checkpointed(cfg, o.activation_checkpointing, allow_auto=True),
        o.ema, "fsdp" if o.fsdp else "ddp", o.num_gpus, _device_memory(o.gpu, o.memory_gib), o.memory_reserve_gib,
        o.trace, len(o.ema_profiles or ()),
    )  # fmt: skip
    show(r, o.json)


def cmd_peaks(args: PeaksArgs) -> None:
    o, device = args, args.gpu if args.gpu is not None else args.device_name
    if device is not None:
        from dit.runtime.precision import (
            PRECISIONS as RUN_PRECISIONS,
        )  # a device is measured in the runtime's mode
        from dit.runtime.precision import Precision

        mode = (
            Precision(o.precision, "cuda").flags() if o.precision in RUN_PRECISIONS else contextlib.nullcontext()
        )
        with mode:
            peak = peaks.resolve_peak(device, o.precision, o.peak_tflops)
        result = dict(device=peak.device, precision=peak.precision, tflops=peak.flops / 1e12, source=peak.source)
        result.update({k: v for k in ("detail", "measured_on") if (v := getattr(peak, k))})
        print(json.dumps(result, indent=2) if o.json else f"peak: {peak.describe()}")
        return
    rows = [
        {"device": d.name, **{p: getattr(d, p) for p in PRECISIONS}, "memory_gib": d.memory_gib} for d in DEVICES
    ]
    if o.json:
        print(json.dumps(rows, indent=2))
        return
    print_table(
        [[r["device"], *("-" if r[k] is None else r[k] for k in (*PRECISIONS, "memory_gib"))] for r in rows],
        ["device", *(f"{p} TF" for p in PRECISIONS), "GiB"],
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
    elif o.chart == "quality":
        print(plots.plot_quality(o.out, o.runs, o.labels))
    else:
        traced = tuple(int(b) for b in o.traced_batches.split(",")) if o.traced_batches else ()
        capacity = _device_memory(o.gpu, o.memory_gib)
        print(plots.plot_memory_vs_batch(o.out, m.config(), o.precision, capacity, traced_batches=traced))


def _money(amount: float) -> str:
    return f"{amount:,.2f}" if amount >= 1 else f"{amount:.3g}"


def cmd_quality(args: QualityArgs) -> None:
    o = args
    from dit.cost.quality import compute_to_target

    r = compute_to_target(o.run, o.target_fid, o.price_per_hour)
    if o.gpu is not None:
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
    print_pairs(pairs)


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


def _main(argv: list[str] | None) -> None:
    parsed = FACE.parse(argv)
    COMMANDS[parsed.command][0](**parsed.sections)


def main(argv: list[str] | None = None) -> int:
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
