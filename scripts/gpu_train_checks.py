"""scripts/gpu_validate.sh's sections on the trainer's path: parallel (DDP, FSDP2, a DCP resume), bench, e2e
(train.py resumed bit for bit, the ledger's MFU), sample (the driver and its records are in ``gpu_validate``)."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

from gpu_context import ROOT, Ctx, _python, _tail

# ---- 5. the trainer's parallel paths: DDP and FSDP2 over compiled, checkpointed blocks; a DCP save and resume -


def _parallel_model(ctx: Ctx, torch, sharded: bool):
    """The DiT as ``Parallelism.wrap`` makes it ready, from seed 0: half its blocks checkpointed inside, every
    block compiled (``parallelize``), then FSDP2 (``shard``: bf16 weights, fp32 reduce) or DDP
    (``data_parallel``); and the trainer's AdamW (fused)."""
    from dit.model.config import model_config
    from dit.model.dit import DiT
    from dit.train.parallel import data_parallel, parallelize

    # XL/2's blocks at the numerics section's batch (one compile cache); a few, so that the save is small
    cfg = model_config("DiT-XL/2", depth=4, class_dropout_prob=0.0) if ctx.cuda else model_config(
        "DiT-S/2", depth=2, hidden_size=64, num_heads=2, input_size=8, num_classes=4, class_dropout_prob=0.0
    )  # fmt: skip
    torch.manual_seed(0)
    model = DiT.from_config(cfg).to(ctx.device)
    for p in model.parameters():  # adaLN-Zero's zero gates would leave the blocks out of the gradients
        torch.nn.init.normal_(p, std=0.02)
    parallelize(model, cfg.depth // 2, True, sharded, torch.bfloat16 if sharded else None)
    module = model if sharded else data_parallel(model, ctx.device)
    return model, module, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _parallel_steps(ctx: Ctx, torch, module, optimizer, steps: int) -> list[float]:
    losses = []
    cfg = getattr(module, "module", module).config
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        n = 8 if ctx.cuda else 4  # the numerics section's batch; on the CPU e2e's (one compile cache)
        x = torch.randn(n, cfg.in_channels, cfg.input_size, cfg.input_size, generator=g).to(ctx.device)
        t = torch.randint(0, 1000, (n,), generator=g).to(ctx.device)
        y = torch.randint(0, cfg.num_classes, (n,), generator=g).to(ctx.device)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            loss = module(x, t, y).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _state(model, optimizer) -> dict:
    from dit.train.parallel import model_state, optimizer_state

    return {"model": model_state(model, True), "optimizer": optimizer_state(model, optimizer, True)}


def _tensors(state: dict) -> list:
    """Every tensor of a state dict, local shards as plain tensors, in a fixed order."""
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if hasattr(state, "to_local"):
        return [state.to_local()]
    return [state] if hasattr(state, "dtype") else []


def section_parallel(ctx: Ctx) -> dict:
    """The trainer's wrapping in a process group of one (NCCL on the device, gloo in the dry run), three AdamW
    steps each: DDP, whose all-reduce over one rank must leave the steps bit for bit as one process's, and FSDP2,
    close to it (its weights are gathered in bf16). Then FSDP2's model and optimizer saved with DCP
    (``dit.checkpoint.sharded``), loaded into a fresh model, and one more step on each: bit for bit."""
    import torch
    import torch.distributed as dist

    from dit.checkpoint import sharded
    from dit.train.parallel import load_model_state, load_optimizer_state

    backend = "nccl" if ctx.cuda else "gloo"
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, device_id=ctx.device if ctx.cuda else None
    )
    figures = {"backend": backend, "world_size": 1, "steps": 3}
    try:
        plain, _, opt = _parallel_model(ctx, torch, sharded=False)
        reference = _parallel_steps(ctx, torch, plain, opt, 3)
        ref_weights = [p.detach().clone() for p in plain.parameters()]
        _, ddp, opt = _parallel_model(ctx, torch, sharded=False)
        ddp_losses = _parallel_steps(ctx, torch, ddp, opt, 3)
        figures["ddp"] = {
            "wrapped": type(ddp).__name__,
            "losses": ddp_losses,
            "weights_equal_to_one_process": all(torch.equal(a, b) for a, b in zip(ref_weights, ddp.parameters())),
        }
        if not figures["ddp"]["weights_equal_to_one_process"] or ddp_losses != reference:
            ctx.problems.append("DDP over one rank: the steps differ from one process's")
        model, _, opt = _parallel_model(ctx, torch, sharded=True)
        losses = _parallel_steps(ctx, torch, model, opt, 3)
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        figures["fsdp"] = {"losses": losses, "reference_losses": reference, "max_rel_loss_gap": gap}
        if gap > 0.05:  # bf16 weights: close to the fp32 weights' losses, not equal
            ctx.problems.append(f"FSDP2: losses {gap:.3g} away from one process's")
        figures["dcp"] = _dcp_resume(ctx, torch, model, opt, sharded, load_model_state, load_optimizer_state)
    finally:
        dist.destroy_process_group()
    return figures


def _dcp_resume(ctx, torch, model, opt, sharded, load_model_state, load_optimizer_state) -> dict:
    folder = ctx.work / "dcp"
    start = time.perf_counter()
    sharded.write(folder, sharded.split(_state(model, opt))[0])  # as the checkpointer splits it
    figures = {"save_seconds": time.perf_counter() - start,
               "bytes": sum(p.stat().st_size for p in folder.iterdir())}  # fmt: skip
    fresh, _, fresh_opt = _parallel_model(ctx, torch, sharded=True)
    _parallel_steps(ctx, torch, fresh, fresh_opt, 1)  # the optimizer's state exists to load into
    tensors, record = sharded.split(_state(fresh, fresh_opt))
    start = time.perf_counter()
    sharded.read_into(folder, tensors)
    state = sharded.merge(record, tensors)
    load_model_state(fresh, state["model"], True)
    load_optimizer_state(fresh, fresh_opt, state["optimizer"], True)
    figures["load_seconds"] = time.perf_counter() - start

    def same() -> bool:
        ours, theirs = _tensors(_state(model, opt)), _tensors(_state(fresh, fresh_opt))
        return len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))

    figures["resumed_equal"] = same()
    figures["next_step_losses_equal"] = _parallel_steps(ctx, torch, model, opt, 1) == _parallel_steps(
        ctx, torch, fresh, fresh_opt, 1
    )
    figures["after_next_step_equal"] = same()
    for check in ("resumed_equal", "next_step_losses_equal", "after_next_step_equal"):
        if not figures[check]:
            ctx.problems.append(f"DCP resume: not {check} bit for bit")
    return figures


# ---- 6. the training benchmark, one process per configuration -----------------------------------------------


def _bench_plan(ctx: Ctx) -> tuple[list[dict], list[str]]:
    """(configurations, common flags): XL/2 bf16 at batch 128 eager and compiled, and at 256 as train.py runs a
    batch that needs it: every block checkpointed inside and compiled."""
    if ctx.cuda:
        common = ["--model", "DiT-XL/2", "--precision", "bf16", "--timed-steps", "8", "--peak-probe", "0"]
        plan = [{"batch": 128, "compile": "off", "checkpointing": "none"},
                {"batch": 128, "compile": "on", "checkpointing": "none"},
                {"batch": 256, "compile": "on", "checkpointing": "all"}]  # fmt: skip
    else:  # a batch no memory holds, to see it skipped by the fit check
        common = ["--model", "DiT-S/8", "--image-size", "64", "--precision", "bf16", "--timed-steps", "2",
                  "--peak-probe", "0", "--peak-tflops", "1", "--memory-gib", "4"]  # fmt: skip
        plan = [{"batch": 2, "compile": "off", "checkpointing": "none"},
                {"batch": 2, "compile": "on", "checkpointing": "all"},
                {"batch": 100_000, "compile": "off", "checkpointing": "none"}]  # fmt: skip
    return plan, common


def section_bench(ctx: Ctx) -> dict:
    """scripts/benchmark.py train per configuration in its own process (compile sees one static shape; a
    crash costs one row), each row appended to DIR/bench.jsonl as it finishes, beside dit-cost's estimate."""
    from dit.cost.memory import estimate_training_memory
    from dit.model.config import model_config, parse_activation_checkpointing

    plan, common = _bench_plan(ctx)
    model, size = common[common.index("--model") + 1], 256 if ctx.cuda else 64
    rows = []
    for i, conf in enumerate(plan):
        ckpt = "" if conf["checkpointing"] == "none" else f"_checkpointed_{conf['checkpointing']}"
        name = f"b{conf['batch']}_compile_{conf['compile']}{ckpt}"
        path = ctx.work / f"{name}.json"
        path.unlink(missing_ok=True)  # a file from an earlier run would pass for this one's
        warmup = "3" if conf["compile"] == "on" else "2" if ctx.cuda else "1"
        argv = ["scripts/benchmark.py", "train", *common, "--global-batch-size", str(conf["batch"]),
                "--compile", conf["compile"], "--activation-checkpointing", conf["checkpointing"],
                "--untimed-steps", warmup, "--out", str(path)]  # fmt: skip
        row = {"name": name, **conf}
        mc = model_config(model, input_size=size // 8)
        blocks = parse_activation_checkpointing(conf["checkpointing"], mc.depth)
        estimate = estimate_training_memory(mc, conf["batch"], "bf16", checkpointed_blocks=blocks).total
        row["estimate_gib"] = estimate / 2**30
        timeout = max(20.0, ctx.left() - 5 - 20 * (len(plan) - i - 1))  # leaves each later row 20 s
        start = time.perf_counter()
        try:
            done = _python(*argv, timeout=timeout)
            if done.returncode != 0:
                row.update(status="failed", error=_tail(done.stderr, 8))
                ctx.problems.append(f"bench {name}: exit status {done.returncode}")
        except subprocess.TimeoutExpired:
            row.update(status="timeout", error=f"over its {timeout:.0f} s")
            ctx.problems.append(f"bench {name}: timed out")
        row["seconds"] = time.perf_counter() - start
        if path.exists():  # written row by row: a crash keeps what finished
            (measured,) = json.loads(path.read_text())["rows"] or [{}]
            if "skipped" in measured:
                row.update(status="skipped", reason=measured["skipped"])
            else:
                row.setdefault("status", "ok")
                for k in ("median_s", "images_per_sec", "model_tflops", "mfu", "hfu", "peak_source",
                          "max_memory_gib", "max_memory_reserved_gib", "checkpointed_blocks", "attention"):  # fmt: skip
                    if k in measured:
                        row[k] = measured[k]
        rows.append(row)
        print(json.dumps(row), flush=True)  # into the log as each row ends
    measured = [r for r in rows if "mfu" in r]
    best = max(measured, key=lambda r: r["mfu"], default=None)
    return {"model": model, "image_size": size, "precision": "bf16", "rows": rows,
            "best_mfu": best and best["mfu"], "best": best and best["name"]}  # fmt: skip


# ---- 7. end to end: a synthetic store, a save, --resume auto ------------------------------------------------


def _e2e_argv(ctx: Ctx, work: Path) -> tuple[list[str], list[str], int]:
    """(train.py's flags, the model's, the batch): XL/2's blocks at 256 px, but four of them (a small save);
    compiled, half of them checkpointed inside, as the trainer runs them; tiny on the CPU."""
    import torch

    from dit.data.store import write_moments_store

    if ctx.cuda:
        model = ["--model", "DiT-XL/2", "--depth", "4", "--image-size", "256", "--num-classes", "1000"]
        images, side, classes, batch, extra = 512, 32, 1000, 64, ["--num-workers", "4"]
    else:
        model = ["--model", "DiT-S/2", "--depth", "2", "--hidden-size", "64", "--num-heads", "2", "--image-size",
                 "64", "--num-classes", "4"]  # fmt: skip
        images, side, classes, batch, extra = 32, 8, 4, 4, ["--num-workers", "0", "--peak-tflops", "0.05"]
    g = torch.Generator().manual_seed(0)
    moments = torch.randn(images, 2, 2, 4, side, side, generator=g).half()
    moments[:, :, 1].abs_()  # the std half
    write_moments_store(str(work / "store"), moments, torch.randint(0, classes, (images,), generator=g), classes)
    common = [*model, "--feature-path", str(work / "store"), "--precision", "bf16", "--global-batch-size",
              str(batch), "--log-every", "5", "--ckpt-every", "10", "--keep-last", "0", "--compile",
              "--activation-checkpointing", "2" if ctx.cuda else "1", "--no-progress", *extra]  # fmt: skip
    return common, model, batch


def _same_checkpoints(a: Path, b: Path) -> bool:
    """Whether two checkpoints hold the same model, EMA and optimizer state, bit for bit."""
    from dit.checkpoint import load_checkpoint

    x, y = load_checkpoint(a), load_checkpoint(b)
    return all(_flat(x[k]) == _flat(y[k]) for k in ("model", "ema")) and _flat(x["optimizer"]["state"]) == _flat(
        y["optimizer"]["state"]
    )


def _flat(state) -> list:
    """A state's tensors as bytes (and its other values as text), in key order: equal lists, equal states."""
    import torch

    if isinstance(state, dict):
        return [b for k in sorted(state, key=str) for b in _flat(state[k])]
    if hasattr(state, "untyped_storage"):
        data = state.detach().cpu().contiguous().view(-1)
        return [str(state.dtype), tuple(state.shape), bytes(data.view(torch.uint8).numpy())]
    return [repr(state)]


def section_e2e(ctx: Ctx) -> dict:
    """train.py as a user runs it, compiled with checkpointed blocks, from a synthetic latent store: 20 steps
    with a save at 10 and 20, then a second run resumed from the save at 10 to 20, whose last checkpoint must
    equal the first's bit for bit. The MFU is the ledger's own (metrics.jsonl); peak reserved memory against
    ``dit-cost memory``; each save's seconds."""
    import runpy
    import shutil

    import torch

    from dit.train.trainer import Trainer

    work = ctx.work
    common, model, batch = _e2e_argv(ctx, work)
    saves = []
    plain_save = Trainer.save

    def timed_save(self):
        self.runtime.sync()
        start = time.perf_counter()
        plain_save(self)
        saves.append(time.perf_counter() - start)

    main = runpy.run_path(str(ROOT / "train.py"))["main"]
    first, resumed = work / "run", work / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    figures = {"argv": common, "runs": []}
    Trainer.save = timed_save
    runs = (["--max-steps", "20", "--results-dir", str(first)],
            ["--max-steps", "20", "--results-dir", str(resumed), "--resume", "auto"])  # fmt: skip
    try:
        for i, argv in enumerate(runs):
            if i == 1:  # a run stopped at step 10
                shutil.copy(first / "checkpoints" / "0000010.pt", resumed / "checkpoints")
            if ctx.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(ctx.device)
            code = main([*common, *argv])
            run = {"argv": argv, "exit_status": code}
            if ctx.cuda:
                run["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved(ctx.device) / 2**30
                run["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
            figures["runs"].append(run)
            if code != 0:
                ctx.problems.append(f"train.py {' '.join(argv)}: exit status {code}")
    finally:
        Trainer.save = plain_save
    records = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind", "train") == "train"]
    timed = [r for r in train if not r["in_warmup"] and r.get("mfu") is not None]
    figures["steps_logged"] = [r["step"] for r in train]
    figures["ledger_mfu"] = statistics.fmean(r["mfu"] for r in timed) if timed else None
    figures["ledger_images_per_sec"] = statistics.fmean(r["images_per_sec"] for r in timed) if timed else None
    figures["save_seconds"] = saves
    last = first / "checkpoints" / "0000020.pt"
    figures["checkpoint_gib"] = last.stat().st_size / 2**30 if last.exists() else None
    figures["resumed"] = "resumed from step 10" in (resumed / "log.txt").read_text()
    figures["resume_bit_for_bit"] = figures["resumed"] and _same_checkpoints(
        last, resumed / "checkpoints" / last.name
    )
    if not figures["resume_bit_for_bit"]:
        ctx.problems.append("the run resumed from step 10 did not reach step 20's checkpoint bit for bit")
    estimate = _python("-m", "dit.cost", "memory", *model, "--batch-size", str(batch), "--precision", "bf16",
                       "--activation-checkpointing", common[common.index("--activation-checkpointing") + 1],
                       "--json", timeout=120)  # fmt: skip
    if estimate.returncode == 0:
        figures["estimate_gib"] = json.loads(estimate.stdout)["estimate_bytes"] / 2**30
    else:
        ctx.problems.append(f"dit-cost memory: {_tail(estimate.stderr, 3)}")
    if ctx.cuda_only("max_memory_reserved", "torch.cuda.max_memory_reserved") and "estimate_gib" in figures:
        figures["reserved_over_estimate"] = figures["runs"][0]["max_memory_reserved_gib"] / figures["estimate_gib"]
    return figures


# ---- 8. sampling throughput ---------------------------------------------------------------------------------


def section_sample(ctx: Ctx) -> dict:
    path = ctx.work / "sample_rows.json"
    if ctx.cuda:
        argv = ["--model", "DiT-XL/2", "--precision", "bf16", "--batch-size", "64", "--num-sampling-steps", "50",
                "--guidance-scale", "4", "--repeats", "2"]  # fmt: skip
    else:
        argv = ["--model", "DiT-S/8", "--image-size", "64", "--precision", "bf16", "--batch-size", "2",
                "--num-sampling-steps", "2", "--repeats", "1", "--peak-tflops", "1"]  # fmt: skip
    done = _python("scripts/benchmark.py", "sample", *argv, "--out", str(path), timeout=max(10.0, ctx.left() - 5))
    if done.returncode != 0:
        raise RuntimeError(f"scripts/benchmark.py sample: exit status {done.returncode}\n{_tail(done.stderr)}")
    (row,) = json.loads(path.read_text())["rows"]
    keep = ("model", "precision", "batch", "num_sampling_steps", "guidance_scale", "attention", "median_s",
            "images_per_sec", "model_tflops", "mfu", "max_memory_gib", "max_memory_reserved_gib")  # fmt: skip
    return {k: row[k] for k in keep if k in row}
