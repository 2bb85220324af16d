"""On a CUDA device (tests/gpu.py's ``cuda`` marker; the CPU with tiny shapes in the dry run): the device and its
peak, TF32 and the legacy flags under each precision, a DiT block's numerics eager / compiled / checkpointed
against float64, every SDPA backend, host syncs in the training step, and a NaN batch."""

from __future__ import annotations

import copy
import json
import logging
import os
import platform
import subprocess
import time
import warnings

import pytest
import torch
from gpu import python, tail

# ---- the device and its peak --------------------------------------------------------------------------------


@pytest.mark.cuda(seconds=15, dry_seconds=60)
def test_env_and_datasheet_peak(ctx):
    """nvidia-smi, the versions, the device's properties, and the bf16 peak ``dit-cost peaks`` gives for it."""
    figures = ctx.figures
    figures.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                   cpu_count=os.cpu_count())  # fmt: skip
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        figures["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except FileNotFoundError:
        ctx.skipped["nvidia_smi"] = "no nvidia-smi on this machine"
    name = "NVIDIA H200"  # the device the real run is prepared for: its row of the peak table
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        name = props.name
        figures.update(device=name, capability=f"{props.major}.{props.minor}",
                       memory_gib=props.total_memory / 2**30, multiprocessors=props.multi_processor_count)  # fmt: skip
    figures["peak_for"] = name
    done = python("-m", "dit.cost", "peaks", "--gpu", name, "--precision", "bf16", "--json", timeout=120)
    assert done.returncode == 0, f"dit-cost peaks --gpu {name!r}: {tail(done.stderr, 3)}"
    peak = json.loads(done.stdout)
    figures.update(peak_bf16_tflops=peak["tflops"], peak_source=peak["source"])
    assert peak["tflops"] > 0 and peak["source"] == "table"


# ---- TF32 and the legacy flags under each precision ---------------------------------------------------------

_GETTERS = {
    "torch.backends.cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "torch.backends.cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    "torch.get_float32_matmul_precision()": lambda: torch.get_float32_matmul_precision(),
    "torch.backends.cuda.matmul.fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
    "torch.backends.cudnn.conv.fp32_precision": lambda: torch.backends.cudnn.conv.fp32_precision,
    "torch.backends.cudnn.rnn.fp32_precision": lambda: torch.backends.cudnn.rnn.fp32_precision,
}


@pytest.mark.cuda(seconds=25, dry_seconds=120)
def test_precision_flags_read_and_compiled_matmul(ctx):
    """Inside ``Precision(name, device).flags()``: every getter (legacy ones too: torch >= 2.9 raises on them
    after a mix of the two APIs, and Inductor reads them) and a compiled matmul against float64."""
    from dit.runtime.precision import PRECISIONS, Precision

    n = 1024 if ctx.cuda else 64
    a, b = (torch.randn(n, n, device=ctx.device) for _ in range(2))
    exact = (a.double() @ b.double()).float()
    for name in PRECISIONS:
        if name == "fp16" and not ctx.cuda_only("fp16", "fp16 autocast"):
            continue
        got = ctx.figures[name] = {}
        with Precision(name, ctx.device.type).flags():
            for getter, read in _GETTERS.items():
                try:
                    got[getter] = read()
                except Exception as e:  # the failure this test exists to find
                    got[getter] = f"error: {type(e).__name__}: {e}"
                    ctx.problems.append(f"{name}: reading {getter} raised {type(e).__name__}: {e}")
            torch._dynamo.reset()  # compiled under these flags, not served from an earlier compile
            out = torch.compile(lambda x, y: x @ y, fullgraph=True)(a, b)
            got["compiled_matmul_rel_error_vs_fp64"] = float((out - exact).norm() / exact.norm())
            got["eager_matmul_rel_error_vs_fp64"] = float(((a @ b) - exact).norm() / exact.norm())
    assert not ctx.problems, ctx.problems


# ---- block numerics and SDPA backends -----------------------------------------------------------------------


class Captured(logging.Handler):
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
        import torch._logging

        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)
        torch._logging.set_logs()


def block_variants(block, backend: str, precision: str):
    """eager; ``checkpointed_compiled`` (what train.py runs: the block's forward checkpoints itself,
    ``DiTBlock.checkpointed``, and the block is compiled whole, as ``dit.train.parallel.parallelize`` does, so its
    recomputation is traced into the graph); in bf16 also compiled without checkpointing, and
    ``checkpoint_of_compiled``, an outer checkpoint around a compiled block, to compare the two orders."""
    from torch.utils.checkpoint import checkpoint

    compiled = torch.compile(block, backend=backend, fullgraph=True)
    inner = torch.compile(block, backend=backend, fullgraph=True)  # its own cache entry: guards see checkpointed

    def checkpointed_compiled(x, c):
        block.checkpointed = True
        try:
            return inner(x, c)
        finally:
            block.checkpointed = False

    variants = {"eager": block, "checkpointed_compiled": checkpointed_compiled}
    if precision == "bf16":  # the run's precision: every order; fp32's costs one compile
        variants["compiled"] = compiled
        variants["checkpoint_of_compiled"] = lambda x, c: checkpoint(compiled, x, c, None, use_reentrant=False)
    return variants


def _max_diff(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _xl2_block(ctx):
    """XL/2's block (width 1152, 16 heads of 72, 256 tokens at 256 px, batch 8), tiny on the CPU; its inputs."""
    from dit.model.config import DiTConfig
    from dit.model.layers import DiTBlock

    width, heads, tokens, n = (1152, 16, 256, 8) if ctx.cuda else (64, 2, 16, 2)
    ctx.figures["block"] = {"width": width, "heads": heads, "tokens": tokens, "batch": n}
    torch.manual_seed(0)
    block = DiTBlock(DiTConfig(hidden_size=width, num_heads=heads)).to(ctx.device)
    for p in block.parameters():  # adaLN-Zero's zero gates would make the block the identity
        torch.nn.init.normal_(p, std=0.02)
    return block, torch.randn(n, tokens, width, device=ctx.device), torch.randn(n, width, device=ctx.device)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.cuda(seconds=20, dry_seconds=90)
def test_block_numerics_compiled_and_checkpointed(ctx, precision):
    """One DiT block eager and compiled / checkpointed (outputs and gradients against eager and float64, each
    variant's first call, its compile, timed): compiled may reorder sums, not lose digits. Dynamo's recompile
    and graph-break messages are kept."""
    base, x0, c0 = _xl2_block(ctx)
    backend = "inductor" if ctx.cuda else "aot_eager"
    if not ctx.cuda:
        ctx.skipped["inductor"] = (
            "Inductor on the CPU takes minutes per block: the dry run compiles with aot_eager"
        )
    dtype = torch.bfloat16 if precision == "bf16" else None

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
    ref = [r.detach().float() for r in run(ref_block, ref_block, x0.double(), c0.double(), dtype=None)]
    torch._dynamo.reset()
    variants = block_variants(base, backend, precision)
    eager = run(variants.pop("eager"), base, x0, c0)
    rows = ctx.figures["variants"] = {"eager": {"max_rel_error_vs_fp64": error(eager, ref)}}
    with Captured() as captured:
        for variant, fn in variants.items():
            start = time.perf_counter()
            got = run(fn, base, x0, c0)  # the first call: its compile included
            rows[variant] = {
                "output_max_abs_diff_vs_eager": _max_diff(got[0], eager[0]),
                "grad_max_abs_diff_vs_eager": max(_max_diff(g, e) for g, e in zip(got[1:], eager[1:])),
                "max_rel_error_vs_fp64": error(got, ref),
                "first_call_seconds": time.perf_counter() - start,
            }
            worst, eager_error = rows[variant]["max_rel_error_vs_fp64"], rows["eager"]["max_rel_error_vs_fp64"]
            if worst > 4 * eager_error + 1e-6:
                ctx.problems.append(f"{variant}: error {worst:.3g} vs eager's {eager_error:.3g}")
    ctx.figures["torch_logs"] = captured.lines
    assert set(rows) == {"eager", "checkpointed_compiled"} | (
        {"compiled", "checkpoint_of_compiled"} if dtype else set()
    )
    assert not ctx.problems, ctx.problems


@pytest.mark.cuda(seconds=10, dry_seconds=60)
def test_sdpa_backends_against_float64(ctx):
    """Every SDPA kernel at XL/2's attention shape, fp32 and bf16, outputs and gradients against float64 math
    attention; on Hopper the flash and efficient kernels must exist in bf16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, heads, tokens, head_dim = (8, 16, 256, 72) if ctx.cuda else (2, 2, 16, 32)
    q0, k0, v0 = (torch.randn(n, heads, tokens, head_dim, device=ctx.device) for _ in range(3))
    ref_qkv = [t.double().requires_grad_() for t in (q0, k0, v0)]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*ref_qkv)
    out.square().mean().backward()
    ref = [out.float(), *(t.grad.float() for t in ref_qkv)]
    kernels = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}  # fmt: skip
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for name, kernel in kernels.items():
            qkv = [t.to(dtype, copy=True).requires_grad_() for t in (q0, k0, v0)]
            try:
                with sdpa_kernel(kernel):
                    out = torch.nn.functional.scaled_dot_product_attention(*qkv)
                out.float().square().mean().backward()
            except RuntimeError as e:
                ctx.figures[f"{name}_{precision}"] = {"unavailable": str(e).splitlines()[0][:300]}
                if not ctx.cuda:
                    ctx.skipped[f"sdpa_{name}_{precision}"] = f"no {name} kernel for {precision} on the CPU"
                elif precision == "bf16" and name in ("flash", "efficient"):
                    ctx.problems.append(f"SDPA {name} unavailable in bf16")
                continue
            got = [out, *(t.grad for t in qkv)]
            ctx.figures[f"{name}_{precision}"] = {
                "output_max_abs_diff_vs_fp64": _max_diff(got[0], ref[0]),
                "grad_max_abs_diff_vs_fp64": max(_max_diff(g, r) for g, r in zip(got[1:], ref[1:])),
            }
    assert ctx.figures["math_fp32"]["output_max_abs_diff_vs_fp64"] < 1e-4
    assert not ctx.problems, ctx.problems


# ---- host syncs in the step, and a NaN batch ----------------------------------------------------------------


def _trainer(ctx):
    """A DiT-S/2 trainer in bf16 on synthetic latents (DiT-S/8 at 64 px on the CPU), its first step taken (the
    optimizer's state exists)."""
    from dit.bench.steps import bench_trainer

    model, size, batch = ("DiT-S/2", 256, 32) if ctx.cuda else ("DiT-S/8", 64, 2)
    ctx.figures.update(model=model, image_size=size, batch=batch, precision="bf16")
    trainer, batches = bench_trainer(
        model, size, batch, str(ctx.work), max_steps=100, precision="bf16", device=ctx.device.type, peak_tflops=1.0
    )
    with trainer.runtime.precision.flags():
        trainer.train_step(batches)
    trainer.runtime.sync()
    return trainer, batches


@pytest.mark.cuda(seconds=12, dry_seconds=60)
def test_no_host_sync_in_train_steps(ctx):
    """Three ``train_step``s under ``set_sync_debug_mode("warn")``: the step reads nothing back."""
    if not ctx.cuda_only("sync_debug_mode", "torch.cuda.set_sync_debug_mode"):
        pytest.skip(ctx.skipped["sync_debug_mode"])
    trainer, batches = _trainer(ctx)
    with trainer.runtime.precision.flags(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                trainer.train_step(batches)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    trainer.runtime.sync()
    trainer.ledger.close()
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    ctx.figures.update(sync_warnings=len(syncs), sync_warning_messages=syncs[:5])
    assert not syncs, f"{len(syncs)} host syncs in 3 training steps"


@pytest.mark.cuda(seconds=12, dry_seconds=120)
def test_a_nan_batch_changes_nothing(ctx):
    """A NaN batch leaves the weights, the EMA and the optimizer's step counts as they were, and is counted."""
    trainer, batches = _trainer(ctx)
    state, runtime = trainer.state, trainer.runtime
    params = lambda m: [p.detach().clone() for p in m.parameters()]  # noqa: E731
    steps = lambda: [s["step"].clone() for s in state.optimizer.state.values() if "step" in s]  # noqa: E731
    before = params(state.model), params(state.ema.model), steps(), state.step
    x, y = batches[0]
    with runtime.precision.flags():
        trainer.train_step([(torch.full_like(x, float("nan")), y)])
    runtime.sync()
    after = params(state.model), params(state.ema.model), steps(), state.step
    counters = trainer.counters.read(runtime)
    trainer.ledger.close()
    same = lambda u, v: len(u) == len(v) and all(torch.equal(a, b) for a, b in zip(u, v))  # noqa: E731
    nan = ctx.figures["nan_batch"] = {
        "weights_unchanged": same(before[0], after[0]),
        "ema_unchanged": same(before[1], after[1]),
        "optimizer_step_counts_unchanged": same(before[2], after[2]) and bool(after[2]),
        "trainer_step_advanced": after[3] == before[3] + 1,
        "nonfinite_steps_counted": counters["nonfinite_steps"],
    }
    assert all(nan[k] for k in ("weights_unchanged", "ema_unchanged", "optimizer_step_counts_unchanged")), nan
    assert nan["nonfinite_steps_counted"] == 1, nan
