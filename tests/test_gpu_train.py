"""On a CUDA device (tests/gpu.py's ``cuda`` marker; the CPU with tiny shapes in the dry run), the trainer's path:
its wrapping in a process group of one (DDP bit for bit as one process, FSDP2 close to it, a DCP save resumed
bit for bit), and train.py itself, compiled with checkpointed blocks, resumed bit for bit."""

from __future__ import annotations

import json
import runpy
import shutil
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gpu import DRY_RUN, ROOT, python, tail

# ---- the trainer's parallel paths: DDP and FSDP2 over compiled, checkpointed blocks; a DCP save and resume ----


@pytest.fixture(scope="module")
def process_group():
    """A process group of one: NCCL on the device, gloo in the dry run."""
    backend = "gloo" if DRY_RUN else "nccl"
    device = None if DRY_RUN else torch.device("cuda:0")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    yield backend
    dist.destroy_process_group()


def _model(ctx, sharded: bool, wrapped: bool = False):
    """The DiT as ``Parallelism.wrap`` makes it ready, from seed 0: half its blocks checkpointed inside, every
    block compiled (``parallelize``), then FSDP2 (``shard``: bf16 weights, fp32 reduce) or, ``wrapped``, DDP
    (``data_parallel``); and the trainer's AdamW (fused). XL/2's blocks, four of them (a small save)."""
    from dit.model.config import model_config
    from dit.model.dit import DiT
    from dit.train.parallel import data_parallel, parallelize

    cfg = model_config("DiT-XL/2", depth=4, class_dropout_prob=0.0) if ctx.cuda else model_config(
        "DiT-S/2", depth=2, hidden_size=64, num_heads=2, input_size=8, num_classes=4, class_dropout_prob=0.0
    )  # fmt: skip
    torch.manual_seed(0)
    model = DiT.from_config(cfg).to(ctx.device)
    for p in model.parameters():  # adaLN-Zero's zero gates would leave the blocks out of the gradients
        torch.nn.init.normal_(p, std=0.02)
    parallelize(model, cfg.depth // 2, True, sharded, torch.bfloat16 if sharded else None)
    module = data_parallel(model, ctx.device) if wrapped else model
    return model, module, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def _steps(ctx, module, optimizer, steps: int) -> list[float]:
    losses = []
    cfg = getattr(module, "module", module).config
    n = 8 if ctx.cuda else 4  # the block numerics' batch; on the CPU e2e's (one compile cache)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
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


def _one_process(ctx):
    """Three steps of the plain model: the reference losses and weights."""
    model, _, optimizer = _model(ctx, sharded=False)
    return _steps(ctx, model, optimizer, 3), [p.detach().clone() for p in model.parameters()]


@pytest.mark.cuda(seconds=18, dry_seconds=600)
def test_ddp_over_one_rank_is_one_process_bit_for_bit(ctx, process_group):
    """DDP's all-reduce over one rank leaves three steps bit for bit as one process's."""
    reference, weights = _one_process(ctx)
    _, ddp, optimizer = _model(ctx, sharded=False, wrapped=True)
    losses = _steps(ctx, ddp, optimizer, 3)
    equal = all(torch.equal(a, b) for a, b in zip(weights, ddp.parameters()))
    ctx.figures.update(backend=process_group, wrapped=type(ddp).__name__, losses=losses, reference=reference)
    assert type(ddp).__name__ == "DistributedDataParallel"
    assert losses == reference and equal


@pytest.mark.cuda(seconds=18, dry_seconds=600)
def test_fsdp2_is_close_to_one_process(ctx, process_group):
    """FSDP2 gathers bf16 weights: its losses stay within 5% of the fp32 weights' (one process)."""
    reference, _ = _one_process(ctx)
    model, _, optimizer = _model(ctx, sharded=True)
    losses = _steps(ctx, model, optimizer, 3)
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    ctx.figures.update(backend=process_group, losses=losses, reference=reference, max_rel_loss_gap=gap)
    assert gap < 0.05


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


@pytest.mark.cuda(seconds=22, dry_seconds=600)
def test_a_dcp_save_of_fsdp2_resumes_bit_for_bit(ctx, process_group):
    """FSDP2's model and optimizer saved with DCP (``dit.checkpoint.sharded``, split as the checkpointer
    splits them), loaded into a fresh model: equal, and one more step on each stays equal."""
    from dit.checkpoint import sharded
    from dit.train.parallel import load_model_state, load_optimizer_state

    model, _, opt = _model(ctx, sharded=True)
    _steps(ctx, model, opt, 2)
    folder = ctx.work / "dcp"
    start = time.perf_counter()
    sharded.write(folder, sharded.split(_state(model, opt))[0])
    ctx.figures.update(
        save_seconds=time.perf_counter() - start, bytes=sum(p.stat().st_size for p in folder.iterdir())
    )
    fresh, _, fresh_opt = _model(ctx, sharded=True)
    _steps(ctx, fresh, fresh_opt, 1)  # the optimizer's state exists to load into
    tensors, record = sharded.split(_state(fresh, fresh_opt))
    start = time.perf_counter()
    sharded.read_into(folder, tensors)
    state = sharded.merge(record, tensors)
    load_model_state(fresh, state["model"], True)
    load_optimizer_state(fresh, fresh_opt, state["optimizer"], True)
    ctx.figures["load_seconds"] = time.perf_counter() - start

    def same() -> bool:
        ours, theirs = _tensors(_state(model, opt)), _tensors(_state(fresh, fresh_opt))
        return len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))

    assert same(), "the resumed state differs from the saved one"
    assert _steps(ctx, model, opt, 1) == _steps(ctx, fresh, fresh_opt, 1)
    assert same(), "one step after the resume, the states differ"


# ---- end to end: train.py from a synthetic store, a save, --resume auto --------------------------------------


def _e2e_argv(ctx, work: Path) -> tuple[list[str], list[str], int]:
    """(train.py's flags, the model's, the batch): XL/2's blocks at 256 px, but four of them (a small save);
    compiled, half of them checkpointed inside, as the trainer runs them; tiny on the CPU."""
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


def _flat(state) -> list:
    """A state's tensors as bytes (and its other values as text), in key order: equal lists, equal states."""
    if isinstance(state, dict):
        return [b for k in sorted(state, key=str) for b in _flat(state[k])]
    if hasattr(state, "untyped_storage"):
        data = state.detach().cpu().contiguous().view(-1)
        return [str(state.dtype), tuple(state.shape), bytes(data.view(torch.uint8).numpy())]
    return [repr(state)]


def _same_checkpoints(a: Path, b: Path) -> bool:
    """Whether two checkpoints hold the same model, EMA and optimizer state, bit for bit."""
    from dit.checkpoint import load_checkpoint

    x, y = load_checkpoint(a), load_checkpoint(b)
    return all(_flat(x[k]) == _flat(y[k]) for k in ("model", "ema")) and _flat(x["optimizer"]["state"]) == _flat(
        y["optimizer"]["state"]
    )


def _train(ctx, main, argv: list[str]) -> dict:
    """One train.py run in this process, its exit status and (on CUDA) its peak memory."""
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    run = {"argv": argv, "exit_status": main(argv)}
    if ctx.cuda:
        run["max_memory_reserved_gib"] = torch.cuda.max_memory_reserved(ctx.device) / 2**30
        run["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    return run


@pytest.mark.cuda(seconds=45, dry_seconds=900)
def test_train_py_resumed_from_a_save_is_bit_for_bit(ctx, monkeypatch):
    """train.py as a user runs it, compiled with checkpointed blocks, from a synthetic latent store: 20 steps with
    a save at 10 and 20, then a run resumed from the save at 10, whose step-20 checkpoint equals the first's bit
    for bit. Recorded: the ledger's own MFU (metrics.jsonl), peak reserved memory against ``dit-cost memory``,
    each save's seconds."""
    from dit.train.trainer import Trainer

    common, model, batch = _e2e_argv(ctx, ctx.work)
    saves, plain_save = [], Trainer.save

    def timed_save(self):
        self.runtime.sync()
        start = time.perf_counter()
        plain_save(self)
        saves.append(time.perf_counter() - start)

    monkeypatch.setattr(Trainer, "save", timed_save)
    main = runpy.run_path(str(ROOT / "train.py"))["main"]
    first, resumed = ctx.work / "run", ctx.work / "resumed"
    runs = ctx.figures["runs"] = [_train(ctx, main, [*common, "--max-steps", "20", "--results-dir", str(first)])]
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(first / "checkpoints" / "0000010.pt", resumed / "checkpoints")  # a run stopped at step 10
    runs.append(
        _train(ctx, main, [*common, "--max-steps", "20", "--results-dir", str(resumed), "--resume", "auto"])
    )
    assert [r["exit_status"] for r in runs] == [0, 0], runs
    records = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind", "train") == "train"]
    timed = [r for r in train if not r["in_warmup"] and r.get("mfu") is not None]
    last = first / "checkpoints" / "0000020.pt"
    ctx.figures.update(
        steps_logged=[r["step"] for r in train], save_seconds=saves, checkpoint_gib=last.stat().st_size / 2**30,
        ledger_mfu=statistics.fmean(r["mfu"] for r in timed) if timed else None,
        ledger_images_per_sec=statistics.fmean(r["images_per_sec"] for r in timed) if timed else None,
    )  # fmt: skip
    estimate = python("-m", "dit.cost", "memory", *model, "--batch-size", str(batch), "--precision", "bf16",
                      "--activation-checkpointing", common[common.index("--activation-checkpointing") + 1],
                      "--json", timeout=120)  # fmt: skip
    assert estimate.returncode == 0, f"dit-cost memory: {tail(estimate.stderr, 3)}"
    ctx.figures["estimate_gib"] = json.loads(estimate.stdout)["estimate_bytes"] / 2**30
    if ctx.cuda_only("max_memory_reserved", "torch.cuda.max_memory_reserved"):
        ctx.figures["reserved_over_estimate"] = runs[0]["max_memory_reserved_gib"] / ctx.figures["estimate_gib"]
    assert "resumed from step 10" in (resumed / "log.txt").read_text()
    assert _same_checkpoints(last, resumed / "checkpoints" / last.name), "step 20's checkpoints differ"
    assert ctx.figures["steps_logged"][-1] == 20 and len(saves) == 3 and ctx.figures["ledger_mfu"] > 0
