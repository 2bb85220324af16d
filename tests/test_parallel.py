"""dit.train.parallel's wiring of a DiT: checkpointing, then compiled blocks, then FSDP2, in that order."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_dit

import dit.train.parallel as parallel
from dit.io.config import FieldError
from dit.model.layers import DiTBlock
from dit.train.parallel import ParallelSection


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, None])
def test_parallelize_checkpoints_then_compiles_then_shards(monkeypatch, param_dtype):
    """torchtitan's order: a block is compiled with its checkpointing inside, and sharded once compiled."""
    import torch.distributed.fsdp as fsdp

    events = []

    def compile(block, **kw):
        events.append(("compile", block, block.checkpointed, kw))

    def fully_shard(module, mp_policy=None, reshard_after_forward=True):
        compiled = [e[1] for e in events if e[0] == "compile"]
        events.append(("shard", module, mp_policy, reshard_after_forward, module in compiled))

    monkeypatch.setattr(DiTBlock, "compile", compile)
    monkeypatch.setattr(fsdp, "fully_shard", fully_shard)
    monkeypatch.setattr(parallel, "pin_cpu_simd_width", lambda: events.append(("pin",)))
    model = tiny_dit(0, depth=3)
    parallel.parallelize(model, checkpointed=2, compile=True, sharded=True, param_dtype=param_dtype)
    assert events.pop(0) == ("pin",)  # a CPU model: the SIMD width in the cache key before any compile
    blocks = list(model.blocks)
    compiled = [e for e in events if e[0] == "compile"]
    assert [e[1] for e in compiled] == blocks and all(e[3] == {"fullgraph": True} for e in compiled)
    assert [e[2] for e in compiled] == [True, True, False]  # checkpointing was in place when each compiled
    shards = [e for e in events if e[0] == "shard"]
    assert [e[1] for e in shards] == [*blocks, model] and events.index(shards[0]) == len(blocks)
    assert [e[3] for e in shards[:-1]] == [True, True, False]  # the last block stays gathered for backward
    assert all(e[4] for e in shards[:-1])  # each block sharded after it was compiled
    for _, _, policy, _, _ in shards[:-1]:
        assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (
            param_dtype,
            torch.float32,
            False,
        )
    assert shards[-1][2] is None  # the rest (pos_embed, embedders, final layer) keeps float32


def test_parallelize_without_compile_or_shards_only_checkpoints(monkeypatch):
    monkeypatch.setattr(DiTBlock, "compile", lambda *a, **k: pytest.fail("compiled"))
    model = parallel.parallelize(tiny_dit(0, depth=3), 1, compile=False, sharded=False, param_dtype=None)
    assert model.checkpoint_mask == [True, False, False]


def test_ddp_bf16_gradients_are_refused_with_fsdp():
    with pytest.raises(FieldError, match="ddp_bf16_grads.*fsdp"):
        ParallelSection(fsdp=True, ddp_bf16_grads=True).check()


@pytest.mark.parametrize("world,fsdp,kind", [(1, True, "Single"), (2, False, "DDP"), (2, True, "FSDP")])
def test_one_factory_picks_the_parallelism_from_the_section_and_world(world, fsdp, kind):
    runtime = type("Runtime", (), {"world": world})()
    chosen = parallel.parallelism(ParallelSection(fsdp=fsdp), runtime)
    assert chosen.__class__ is getattr(parallel, kind) and chosen.split == (kind == "FSDP")


def test_the_trainer_names_no_parallelism():
    """DDP or FSDP live behind ``dit.train.parallel.Parallelism``: the trainer calls it without naming either."""
    import re

    import dit.train.parts as parts
    import dit.train.trainer as trainer

    source = open(trainer.__file__).read() + open(parts.__file__).read()
    found = re.findall(r".*(?:fsdp|shard|ddp|no_sync|full_tensor).*", source, flags=re.IGNORECASE)
    assert not found, found


_COMPILE_RSQRT = """
import torch
from dit.train.parallel import pin_cpu_simd_width
pin_cpu_simd_width()
x = torch.rand(64) + 1
torch.testing.assert_close(torch.compile(torch.rsqrt)(x), torch.rsqrt(x))
"""


@pytest.mark.slow
def test_compiled_cpu_kernels_from_one_cache_match_eager_under_each_instruction_set(tmp_path):
    """One inductor cache, filled under AVX-512, then read under AVX2: unpinned, the AVX2 process reused the
    16-lane loops and left half of the 64 outputs unwritten (in the compiled DiT blocks: NaN)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    if not {256, 512} <= {isa.bit_width() for isa in valid_vec_isa_list()}:
        pytest.skip("needs a CPU with AVX-512 and AVX2")
    for capability in ("avx512", "avx2"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), ATEN_CPU_CAPABILITY=capability)
        run = subprocess.run([sys.executable, "-c", _COMPILE_RSQRT], env=env, capture_output=True, text=True)
        assert run.returncode == 0, f"{capability}: {run.stderr[-2000:]}"


@pytest.mark.parametrize("every_rank", [True, False])
def test_the_fsdp_gather_builds_no_random_model(tmp_path, monkeypatch, every_rank):
    """``FSDP.whole`` (each grid and evaluation) takes the gathered weights into a DiT built on the meta device:
    no random initialisation runs (it built and initialised a whole DiT each time), and the whole model,
    RoPE's tables (outside the state dict) included, computes exactly what the model computed."""
    import torch.distributed as dist
    from helpers import TINY, randomize

    from dit.model.dit import DiT
    from dit.runtime import Runtime

    model = randomize(DiT(**{**TINY, "rope": True}), 0).eval()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 2])
    with torch.no_grad():
        expected = model(x, t, y)
    inits, xavier = [], torch.nn.init.xavier_uniform_
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        parallel.shard(model)
        monkeypatch.setattr(
            torch.nn.init, "xavier_uniform_", lambda w, *a, **k: inits.append(w) or xavier(w, *a, **k)
        )
        whole = parallel.FSDP(ParallelSection(fsdp=True), Runtime("cpu")).whole(model, every_rank)
    finally:
        dist.destroy_process_group()
    assert inits == []  # DiT.initialize_weights draws its Xavier weights on any real device
    assert not any(t.is_meta for t in (*whole.parameters(), *whole.buffers()))
    with torch.no_grad():
        assert torch.equal(whole(x, t, y), expected)
