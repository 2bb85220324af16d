"""The sections of scripts/gpu_validate.sh, one subcommand each, so that each runs (and is tested) alone.

  python scripts/gpu_validate.py SECTION --out DIR [--dry-run] [--budget SECONDS] [--fail]
  python scripts/gpu_validate.py finish SECTION --out DIR --rc RC --seconds S   # after the section's process

A section writes its record, {name, status (ok, failed, skipped), seconds, figures}, to DIR/sections/NAME.json
when it ends; ``finish`` writes one for a section whose process died or timed out without writing it
(status failed or timeout, the log's tail kept), then gathers every record into DIR/gpu_validate.json. A check
that does not hold is listed in the figures' ``problems`` and fails its section; a part that cannot run on
this machine (a CUDA-only check in the CPU dry run) is listed in ``skipped_parts`` with the reason.
``--dry-run`` runs every section on the CPU with tiny shapes; ``--fail`` makes the section fail at once (to
test that the others still run).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from dit.io.cli import run_cli
from dit.io.config import Face, FieldError, Section, option

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("env", "flags", "numerics", "sync", "bench", "e2e", "sample")
STATUSES = ("ok", "failed", "timeout", "skipped")
TIMEOUT_CODES = (124, 137)  # timeout(1): the limit passed, or the process had to be killed


class Ctx:
    """What a section runs on: the real shapes on the GPU, tiny ones on the CPU in a dry run."""

    def __init__(self, out: Path, dry_run: bool, budget: float):
        import torch

        self.out, self.dry_run, self.budget, self.start = out, dry_run, budget, time.perf_counter()
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.cuda = self.device.type == "cuda"
        self.skipped: dict[str, str] = {}
        self.problems: list[str] = []

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def cuda_only(self, part: str, what: str) -> bool:
        """True on CUDA; else records ``part`` as skipped (``what`` needs CUDA)."""
        if not self.cuda:
            self.skipped[part] = f"{what} is CUDA-only: skipped in the CPU dry run"
        return self.cuda


def _python(*argv: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ---- 1. environment and peak --------------------------------------------------------------------------------


def section_env(ctx: Ctx) -> dict:
    import platform

    import torch

    figures = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu_count": os.cpu_count(),
    }
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        figures["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except FileNotFoundError:
        ctx.skipped["nvidia_smi"] = "no nvidia-smi on this machine"
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        name = props.name
        figures.update(
            device=name, capability=f"{props.major}.{props.minor}", memory_gib=props.total_memory / 2**30,
            multiprocessors=props.multi_processor_count,
        )  # fmt: skip
    else:
        name = "NVIDIA H200"  # the device the real run is prepared for: its row of the peak table
        figures["device"] = "cpu"
    figures["peak_for"] = name
    done = _python("-m", "dit.cost", "peaks", "--gpu", name, "--precision", "bf16", "--json", timeout=120)
    if done.returncode != 0:
        ctx.problems.append(f"dit-cost peaks --gpu {name!r}: {_tail(done.stderr, 3)}")
    else:
        peak = json.loads(done.stdout)
        figures.update(peak_bf16_tflops=peak["tflops"], peak_source=peak["source"])
    return figures


# ---- 2. TF32 and the legacy flags under each precision ------------------------------------------------------

_GETTERS = {
    "torch.backends.cuda.matmul.allow_tf32": lambda t: t.backends.cuda.matmul.allow_tf32,
    "torch.backends.cudnn.allow_tf32": lambda t: t.backends.cudnn.allow_tf32,
    "torch.get_float32_matmul_precision()": lambda t: t.get_float32_matmul_precision(),
    "torch.backends.cuda.matmul.fp32_precision": lambda t: t.backends.cuda.matmul.fp32_precision,
    "torch.backends.cudnn.conv.fp32_precision": lambda t: t.backends.cudnn.conv.fp32_precision,
    "torch.backends.cudnn.rnn.fp32_precision": lambda t: t.backends.cudnn.rnn.fp32_precision,
}


def section_flags(ctx: Ctx) -> dict:
    """Inside ``Precision(name, device).flags()``: every getter (legacy ones too: torch >= 2.9 raises on them
    after a mix of the two APIs, and Inductor reads them) and a compiled matmul against float64."""
    import torch

    from dit.runtime.precision import PRECISIONS, Precision

    figures = {}
    n = 1024 if ctx.cuda else 64
    a, b = (torch.randn(n, n, device=ctx.device) for _ in range(2))
    exact = (a.double() @ b.double()).float()
    for name in PRECISIONS:
        if name == "fp16" and not ctx.cuda_only("fp16", "fp16 autocast"):
            continue
        got = {}
        try:
            with Precision(name, ctx.device.type).flags():
                for getter, read in _GETTERS.items():
                    try:
                        got[getter] = read(torch)
                    except Exception as e:  # the failure this section exists to find
                        got[getter] = f"error: {type(e).__name__}: {e}"
                        ctx.problems.append(f"{name}: reading {getter} raised {type(e).__name__}: {e}")
                torch._dynamo.reset()  # compiled under these flags, not served from an earlier compile
                out = torch.compile(lambda x, y: x @ y, fullgraph=True)(a, b)
                got["compiled_matmul_rel_error_vs_fp64"] = float((out - exact).norm() / exact.norm())
                got["eager_matmul_rel_error_vs_fp64"] = float(((a @ b) - exact).norm() / exact.norm())
        except Exception as e:
            got["error"] = f"{type(e).__name__}: {e}"
            ctx.problems.append(f"{name}: {type(e).__name__}: {e}")
        figures[name] = got
    return figures


# ---- 3. block numerics and SDPA backends --------------------------------------------------------------------


class _Captured(logging.Handler):
    """TORCH_LOGS=recompiles,graph_breaks, kept for the record."""

    LOGGERS = ("torch", "torch._dynamo")  # torch._dynamo does not propagate to torch when logging is set

    def __init__(self):
        super().__init__()
        self.lines: dict[str, list[str]] = {"recompiles": [], "graph_breaks": []}
        self.seen: set[int] = set()

    def emit(self, record):
        if id(record) in self.seen:
            return
        self.seen.add(id(record))
        for kind in self.lines:
            if record.name.endswith(f"__{kind}"):
                self.lines[kind].append(record.getMessage()[:2000])

    def __enter__(self):
        import torch._logging

        torch._logging.set_logs(recompiles=True, graph_breaks=True)
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


def _block_variants(block, backend: str):
    """eager; compiled; checkpoint(compiled) (the trainer's order: DiT.forward checkpoints a compiled block);
    compile(checkpoint(block)) (torchtitan's order)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    compiled = torch.compile(block, backend=backend, fullgraph=True)
    return {
        "eager": block,
        "compiled": compiled,
        "checkpoint_of_compiled": lambda x, c: checkpoint(compiled, x, c, None, use_reentrant=False),
        "compiled_checkpoint": torch.compile(
            lambda x, c: checkpoint(block, x, c, None, use_reentrant=False), backend=backend, fullgraph=True
        ),
    }


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def section_numerics(ctx: Ctx) -> dict:
    """One DiT block eager vs compiled vs checkpointed (outputs and gradients, fp32 and bf16, max abs diff to
    eager and to float64), then every SDPA backend against float64 math attention; Dynamo's recompile and
    graph-break messages kept."""
    import torch

    with _Captured() as captured:
        figures = _numerics(ctx, torch)
    figures["torch_logs"] = captured.lines
    figures["recompiles"] = len(captured.lines["recompiles"])
    figures["graph_breaks"] = len(captured.lines["graph_breaks"])
    return figures


def _numerics(ctx: Ctx, torch) -> dict:
    import copy

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dit.model.config import DiTConfig
    from dit.model.layers import DiTBlock

    # XL/2's block (width 1152, 16 heads of 72, 256 tokens at 256 px); tiny on the CPU
    width, heads, tokens, n = (1152, 16, 256, 8) if ctx.cuda else (64, 2, 16, 2)
    backend = "inductor" if ctx.cuda else "aot_eager"
    if not ctx.cuda:
        ctx.skipped["inductor"] = (
            "Inductor on the CPU takes minutes per block: the dry run compiles with aot_eager"
        )
    figures = {"block": {"width": width, "heads": heads, "tokens": tokens, "batch": n, "compile_backend": backend}}
    torch.manual_seed(0)
    base = DiTBlock(DiTConfig(hidden_size=width, num_heads=heads)).to(ctx.device)
    for p in base.parameters():  # adaLN-Zero's zero gates would make the block the identity
        torch.nn.init.normal_(p, std=0.02)
    x0, c0 = torch.randn(n, tokens, width, device=ctx.device), torch.randn(n, width, device=ctx.device)
    for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):

        def run(fn, block, x, c, dtype=dtype):
            x, c = x.clone().requires_grad_(), c.clone().requires_grad_()
            block.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                y = fn(x, c)
            y.float().square().mean().backward()
            return [y.float(), x.grad, c.grad, *(p.grad for p in block.parameters())]

        def error(got, ref):  # the worst of output and gradients, relative to each tensor's largest value
            return max(_max_diff(g, r) / (float(r.abs().max()) or 1.0) for g, r in zip(got, ref))

        ref_block = copy.deepcopy(base).double()
        ref = [r.float() for r in run(ref_block, ref_block, x0.double(), c0.double(), dtype=None)]
        torch._dynamo.reset()
        variants = _block_variants(base, backend)
        eager = run(variants.pop("eager"), base, x0, c0)
        rows = {"eager": {"max_rel_error_vs_fp64": error(eager, ref)}}
        for variant, fn in variants.items():
            try:
                got = run(fn, base, x0, c0)
            except Exception as e:
                rows[variant] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                ctx.problems.append(f"block {precision} {variant}: {type(e).__name__}")
                continue
            rows[variant] = {
                "output_max_abs_diff_vs_eager": _max_diff(got[0], eager[0]),
                "grad_max_abs_diff_vs_eager": max(_max_diff(g, e) for g, e in zip(got[1:], eager[1:])),
                "max_rel_error_vs_fp64": error(got, ref),
            }
            worst, eager_error = rows[variant]["max_rel_error_vs_fp64"], rows["eager"]["max_rel_error_vs_fp64"]
            if worst > 4 * eager_error + 1e-6:  # compiled may reorder sums, not lose digits
                ctx.problems.append(f"block {precision} {variant}: error {worst:.3g} vs eager's {eager_error:.3g}")
        figures[f"block_{precision}"] = rows

    head_dim = width // heads
    q0, k0, v0 = (torch.randn(n, heads, tokens, head_dim, device=ctx.device) for _ in range(3))
    ref_qkv = [t.double().requires_grad_() for t in (q0, k0, v0)]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*ref_qkv)
    out.square().mean().backward()
    ref = [out.float(), *(t.grad.float() for t in ref_qkv)]
    kernels = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}  # fmt: skip
    sdpa = {}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for name, kernel in kernels.items():
            qkv = [t.to(dtype, copy=True).requires_grad_() for t in (q0, k0, v0)]
            try:
                with sdpa_kernel(kernel):
                    out = torch.nn.functional.scaled_dot_product_attention(*qkv)
                out.float().square().mean().backward()
            except RuntimeError as e:
                sdpa[f"{name}_{precision}"] = {"unavailable": str(e).splitlines()[0][:300]}
                if not ctx.cuda:
                    ctx.skipped[f"sdpa_{name}_{precision}"] = f"no {name} kernel for {precision} on the CPU"
                elif precision == "bf16" and name in ("flash", "efficient"):  # Hopper has both in bf16
                    ctx.problems.append(f"SDPA {name} unavailable in bf16")
                continue
            got = [out, *(t.grad for t in qkv)]
            sdpa[f"{name}_{precision}"] = {
                "output_max_abs_diff_vs_fp64": _max_diff(got[0], ref[0]),
                "grad_max_abs_diff_vs_fp64": max(_max_diff(g, r) for g, r in zip(got[1:], ref[1:])),
            }
    figures["sdpa"] = sdpa
    return figures


# ---- 4. host syncs in the step, and a NaN batch -------------------------------------------------------------


def section_sync(ctx: Ctx) -> dict:
    """Three ``train_step``s under ``set_sync_debug_mode("warn")`` (none expected: the step reads nothing
    back), then a NaN batch: the weights, the EMA and the optimizer's step counts must stay as they were."""
    import tempfile
    import warnings

    import torch

    from dit.bench.steps import bench_trainer

    model, size, batch = ("DiT-S/2", 256, 32) if ctx.cuda else ("DiT-S/8", 64, 2)
    figures = {"model": model, "image_size": size, "batch": batch, "precision": "bf16"}
    with tempfile.TemporaryDirectory() as tmp:
        trainer, batches = bench_trainer(
            model, size, batch, tmp, max_steps=100, precision="bf16", device=ctx.device.type, peak_tflops=1.0
        )
        runtime = trainer.runtime
        with runtime.precision.flags():
            trainer.train_step(batches)  # the first step creates the optimizer state
            runtime.sync()
            if ctx.cuda_only("sync_debug_mode", "torch.cuda.set_sync_debug_mode"):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        for _ in range(3):
                            trainer.train_step(batches)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                runtime.sync()
                syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
                figures["sync_warnings"] = len(syncs)
                figures["sync_warning_messages"] = syncs[:5]
                if syncs:
                    ctx.problems.append(f"{len(syncs)} host syncs in 3 training steps")
            state = trainer.state
            params = lambda m: [p.detach().clone() for p in m.parameters()]  # noqa: E731
            steps = lambda: [s["step"].clone() for s in state.optimizer.state.values() if "step" in s]  # noqa: E731
            before = params(state.model), params(state.ema.model), steps(), state.step
            x, y = batches[0]
            trainer.train_step([(torch.full_like(x, float("nan")), y)])
            runtime.sync()
            after = params(state.model), params(state.ema.model), steps(), state.step
        counters = trainer.counters.read(runtime)
        trainer.ledger.close()
    same = lambda u, v: len(u) == len(v) and all(torch.equal(a, b) for a, b in zip(u, v))  # noqa: E731
    figures["nan_batch"] = {
        "weights_unchanged": same(before[0], after[0]),
        "ema_unchanged": same(before[1], after[1]),
        "optimizer_step_counts_unchanged": same(before[2], after[2]),
        "optimizer_step_count": float(after[2][0]) if after[2] else None,
        "trainer_step_advanced": after[3] == before[3] + 1,
        "nonfinite_steps_counted": counters["nonfinite_steps"],
    }
    for check in ("weights_unchanged", "ema_unchanged", "optimizer_step_counts_unchanged"):
        if not figures["nan_batch"][check]:
            ctx.problems.append(f"NaN batch: not {check}")
    if counters["nonfinite_steps"] != 1:
        ctx.problems.append(f"NaN batch: {counters['nonfinite_steps']} non-finite steps counted, not 1")
    return figures


# ---- 5. the training benchmark, one process per configuration -----------------------------------------------


def _jsonl(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _bench_plan(ctx: Ctx) -> tuple[list[dict], list[str]]:
    """(configurations, common flags): XL/2 bf16 at the batches that fit, compile off and on."""
    if ctx.cuda:
        common = ["--model", "DiT-XL/2", "--precision", "bf16", "--timed-steps", "8", "--peak-probe", "0"]
        plan = [{"batch": b, "compile": "off"} for b in (64, 128, 256)]
        plan += [{"batch": b, "compile": "on"} for b in (128, 256)]  # about 30 s of Inductor each
    else:  # a batch no memory holds, to see it skipped by the fit check, and no Inductor
        common = ["--model", "DiT-S/8", "--image-size", "64", "--precision", "bf16", "--timed-steps", "2",
                  "--peak-probe", "0", "--peak-tflops", "1", "--memory-gib", "4"]  # fmt: skip
        plan = [{"batch": b, "compile": "off"} for b in (2, 100_000)]
        ctx.skipped["compile_on"] = (
            "Inductor on the CPU takes minutes per block: the dry run times eager steps only"
        )
    return plan, common


def section_bench(ctx: Ctx) -> dict:
    """scripts/benchmark.py train per configuration in its own process (compile sees one static shape; a
    crash costs one row), each row appended to DIR/bench.jsonl as it finishes, beside dit-cost's estimate."""
    from dit.cost.memory import estimate_training_memory
    from dit.model.config import model_config

    plan, common = _bench_plan(ctx)
    model, size = common[common.index("--model") + 1], 256 if ctx.cuda else 64
    rows_dir, jsonl = ctx.out / "bench", ctx.out / "bench.jsonl"
    rows_dir.mkdir(parents=True, exist_ok=True)
    jsonl.unlink(missing_ok=True)
    rows = []
    for i, conf in enumerate(plan):
        name = f"b{conf['batch']}_compile_{conf['compile']}"
        path = rows_dir / f"{name}.json"
        path.unlink(missing_ok=True)  # a file from an earlier run would pass for this one's
        warmup = "5" if conf["compile"] == "on" else "2" if ctx.cuda else "1"
        argv = ["scripts/benchmark.py", "train", *common, "--global-batch-size", str(conf["batch"]),
                "--compile", conf["compile"], "--untimed-steps", warmup, "--out", str(path)]  # fmt: skip
        row = {"name": name, **conf}
        estimate = estimate_training_memory(model_config(model, input_size=size // 8), conf["batch"], "bf16").total
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
        _jsonl(jsonl, row)
    measured = [r for r in rows if "mfu" in r]
    best = max(measured, key=lambda r: r["mfu"], default=None)
    return {"model": model, "image_size": size, "precision": "bf16", "rows": rows,
            "best_mfu": best and best["mfu"], "best": best and best["name"]}  # fmt: skip


# ---- 6. end to end: a synthetic store, a save, --resume auto ------------------------------------------------


def section_e2e(ctx: Ctx) -> dict:
    """train.py twice from a synthetic latent store (20 steps and a save, then ``--resume auto`` to 40): the
    ledger's MFU against the benchmark's, peak reserved memory against ``dit-cost memory``, the save time."""
    import runpy
    import shutil

    import torch

    from dit.data.store import write_moments_store
    from dit.train.trainer import Trainer

    work = ctx.out / "e2e"
    shutil.rmtree(work, ignore_errors=True)
    if ctx.cuda:
        model = ["--model", "DiT-XL/2", "--image-size", "256", "--num-classes", "1000"]
        images, side, classes, batch, extra = 512, 32, 1000, 64, ["--num-workers", "4"]  # the bench's first row
    else:
        model = ["--model", "DiT-S/2", "--depth", "2", "--hidden-size", "64", "--num-heads", "2", "--image-size",
                 "64", "--num-classes", "4"]  # fmt: skip
        images, side, classes, batch, extra = 32, 8, 4, 4, ["--num-workers", "0", "--peak-tflops", "0.05"]
    g = torch.Generator().manual_seed(0)
    moments = torch.randn(images, 2, 2, 4, side, side, generator=g).half()
    moments[:, :, 1].abs_()  # the std half
    write_moments_store(str(work / "store"), moments, torch.randint(0, classes, (images,), generator=g), classes)
    common = [*model, "--feature-path", str(work / "store"), "--precision", "bf16", "--global-batch-size",
              str(batch), "--log-every", "5", "--ckpt-every", "1000", "--results-dir", str(work / "run"),
              "--no-progress", *extra]  # fmt: skip
    saves = []
    plain_save = Trainer.save

    def timed_save(self):
        self.runtime.sync()
        start = time.perf_counter()
        plain_save(self)
        saves.append(time.perf_counter() - start)

    main = runpy.run_path(str(ROOT / "train.py"))["main"]
    figures = {"argv": common, "runs": []}
    Trainer.save = timed_save
    try:
        for argv in (["--max-steps", "20"], ["--max-steps", "40", "--resume", "auto"]):
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
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind", "train") == "train"]
    timed = [r for r in train if not r["in_warmup"] and r.get("mfu") is not None]
    figures["steps_logged"] = [r["step"] for r in train]
    figures["ledger_mfu"] = statistics.fmean(r["mfu"] for r in timed) if timed else None
    figures["ledger_images_per_sec"] = statistics.fmean(r["images_per_sec"] for r in timed) if timed else None
    figures["save_seconds"] = saves
    ckpts = sorted((work / "run" / "checkpoints").glob("*.pt"))
    figures["checkpoint_gib"] = ckpts[-1].stat().st_size / 2**30 if ckpts else None
    log = (work / "run" / "log.txt").read_text()
    figures["resumed"] = "resumed from step 20" in log
    if not figures["resumed"] or not train or train[-1]["step"] != 40:
        ctx.problems.append("the resumed run did not continue from step 20 to 40")
    estimate = _python("-m", "dit.cost", "memory", *model, "--batch-size", str(batch), "--precision", "bf16",
                       "--json", timeout=120)  # fmt: skip
    if estimate.returncode == 0:
        figures["estimate_gib"] = json.loads(estimate.stdout)["estimate_bytes"] / 2**30
    else:
        ctx.problems.append(f"dit-cost memory: {_tail(estimate.stderr, 3)}")
    if ctx.cuda_only("max_memory_reserved", "torch.cuda.max_memory_reserved") and "estimate_gib" in figures:
        figures["reserved_over_estimate"] = figures["runs"][0]["max_memory_reserved_gib"] / figures["estimate_gib"]
    bench = ctx.out / "sections" / "bench.json"
    if bench.exists() and figures["ledger_mfu"]:  # the benchmark's eager row at this batch, if it ran
        rows = json.loads(bench.read_text())["figures"].get("rows", [])
        same = [r for r in rows if r.get("batch") == batch and r.get("compile") == "off" and "mfu" in r]
        if same:
            figures["bench_mfu"] = same[0]["mfu"]
            figures["ledger_over_bench_mfu"] = figures["ledger_mfu"] / same[0]["mfu"]
    return figures


# ---- 7. sampling throughput ---------------------------------------------------------------------------------


def section_sample(ctx: Ctx) -> dict:
    path = ctx.out / "sample_rows.json"
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


# ---- records ------------------------------------------------------------------------------------------------


def _write(path: Path, record) -> None:
    from dit.io.atomic import atomic_write_bytes

    atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())


def run_section(name: str, out: Path, dry_run: bool, budget: float, fail: bool) -> int:
    start = time.perf_counter()
    record = {"name": name, "status": "ok", "seconds": None, "figures": {}}
    try:
        ctx = Ctx(out, dry_run, budget)
        if fail:
            raise RuntimeError("made to fail (--fail)")
        record["figures"] = globals()[f"section_{name}"](ctx)
        if ctx.skipped:
            record["figures"]["skipped_parts"] = ctx.skipped
        if ctx.problems:
            record.update(status="failed", problems=ctx.problems)
    except Exception as e:
        record.update(
            status="failed", error=f"{type(e).__name__}: {e}", traceback=_tail(traceback.format_exc(), 20)
        )
    record["seconds"] = time.perf_counter() - start
    _write(out / "sections" / f"{name}.json", record)
    return 0 if record["status"] == "ok" else 1


def finish(name: str, out: Path, rc: int, seconds: float, dry_run: bool) -> int:
    """A record for a section whose process wrote none (killed, timed out, crashed), then the gathered file."""
    path = out / "sections" / f"{name}.json"
    if not path.exists():
        log = out / "logs" / f"{name}.log"
        record = {
            "name": name,
            "status": "timeout" if rc in TIMEOUT_CODES else "failed",
            "seconds": seconds,
            "figures": {},
            "error": f"the section's process ended with status {rc} and wrote no record",
            "log_tail": _tail(log.read_text(errors="replace")) if log.exists() else "",
        }
        _write(path, record)
    records = {p.stem: json.loads(p.read_text()) for p in (out / "sections").glob("*.json")}
    _write(
        out / "gpu_validate.json",
        {"dry_run": dry_run, "complete": set(SECTIONS) <= set(records),
         "sections": [records[s] for s in SECTIONS if s in records]},
    )  # fmt: skip
    return 0


@dataclass(frozen=True)
class ValidateConfig(Section):
    """One section of scripts/gpu_validate.sh, or ``finish SECTION`` after its process."""

    section: str = option(choices=(*SECTIONS, "finish"), positional=True, help="the section to run, or finish")
    name: str | None = option(None, f"finish: the section ({', '.join(SECTIONS)})", positional=True)
    out: str = option("results/gpu_validate", "the folder of the records and logs")
    dry_run: bool = option(False, "the CPU, tiny shapes")
    budget: float = option(600.0, "seconds this section may take", gt=0)
    fail: bool = option(False, "fail at once (tests that the others still run)")
    rc: int = option(0, "finish: the section process's exit status")
    seconds: float | None = option(None, "finish: how long it ran", ge=0)

    def check(self) -> None:
        if self.section == "finish" and self.name not in SECTIONS:  # an optional positional takes no choices
            raise FieldError(f"finish needs a section's name ({', '.join(SECTIONS)}), got {self.name}.")


FACE = Face("scripts/gpu_validate.py", __doc__, sections={"validate": ValidateConfig}, outputs={"out": "folder"})


def main(argv=None) -> int:
    a = FACE.parse(argv).sections["validate"]
    if a.section == "finish":
        return finish(a.name, Path(a.out), a.rc, a.seconds, a.dry_run)
    return run_section(a.section, Path(a.out), a.dry_run, a.budget, a.fail)


if __name__ == "__main__":
    sys.exit(run_cli(main))
