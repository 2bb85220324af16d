"""Checkpoint saves across processes: rank 0 alone builds the host copy; the group waits long enough for it."""

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from dit.train import TrainConfig, train

REPO = Path(__file__).resolve().parents[1]

# Each rank builds the same TrainState, counts the host copies ``state_dict`` makes and the whole tensors FSDP
# gathers, and writes what it got.
SPY = """
import json, os, sys
import torch
import dit.train.state as state_mod
from torch.distributed.tensor import DTensor
from dit.runtime import Runtime
from dit.train.ema import EMA
from dit.train.state import TrainState
from helpers import tiny_dit

from dit.train.parallel import shard

copies, gathers = [], []  # (function, tensors it returned on this rank); DTensor.full_tensor calls
for name in ("model_state", "optimizer_state"):
    real = getattr(state_mod, name)

    def spy(*a, _real=real, _name=name):
        out = _real(*a)
        copies.append((_name, len(out) if _name == "model_state" else len(out.get("state", {}))))
        return out

    setattr(state_mod, name, spy)
full_tensor = DTensor.full_tensor
DTensor.full_tensor = lambda self, *a, **k: gathers.append(1) or full_tensor(self, *a, **k)
out = {}
with Runtime("cpu") as rt:
    for sharded in (False, True):
        copies.clear(), gathers.clear()
        model = tiny_dit(0)
        ema = EMA(model)
        if sharded:
            shard(model), shard(ema.model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        model(torch.randn(2, 4, 8, 8), torch.rand(2), torch.tensor([0, 1])).sum().backward()
        opt.step()  # an optimizer state to copy
        payload = TrainState(model, ema, opt, None, sharded, 16, 2).state_dict(rt)
        local = payload and {k: v.to_local().numel() if isinstance(v, DTensor) else -1
                             for k, v in payload["model"].items()}
        out["fsdp" if sharded else "ddp"] = {"copies": sorted(copies), "payload": payload and sorted(payload),
                                             "gathers": len(gathers), "local": local,
                                             "whole": {k: v.numel() for k, v in model.state_dict().items()}}
    with open(os.path.join(sys.argv[1], f"rank{rt.rank}.json"), "w") as f:
        json.dump(out, f)
"""


def test_only_rank_0_holds_a_host_copy_under_ddp_and_fsdp_ranks_keep_their_shards(tmp_path):
    script = tmp_path / "spy.py"
    script.write_text(SPY)
    env = {**__import__("os").environ}
    env["PYTHONPATH"] = f"{REPO / 'tests'}:{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    done = subprocess.run([*cmd, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    names = [name for name, _ in rank0["ddp"]["copies"]]
    assert names == ["model_state", "model_state", "optimizer_state"]
    assert all(n > 0 for _, n in rank0["ddp"]["copies"]) and {"model", "ema", "optimizer", "rng"} <= set(
        rank0["ddp"]["payload"]
    )
    assert rank1["ddp"]["copies"] == [] and rank1["ddp"]["payload"] is None  # no host copy on rank 1
    # FSDP: every rank holds its own shards of the whole payload, and no tensor is gathered whole
    for rank in (rank0, rank1):
        assert {"model", "ema", "optimizer", "rng", "config", "lineage"} <= set(rank["fsdp"]["payload"])
        assert rank["fsdp"]["gathers"] == 0
    for k, whole in rank0["fsdp"][
        "whole"
    ].items():  # each tensor split between the ranks (dim 0: 1-row ones whole)
        assert rank0["fsdp"]["local"][k] + rank1["fsdp"]["local"][k] == whole, k
    total = sum(rank0["fsdp"]["whole"].values())
    assert all(sum(rank["fsdp"]["local"].values()) < 0.6 * total for rank in (rank0, rank1))  # none holds it all


class _Joined(Exception):
    pass


def test_the_process_group_timeout_is_the_runs(tmp_path, monkeypatch):
    """--dist-timeout-min reaches init_process_group (torch's 10 min NCCL default could end a run mid-save)."""
    seen = {}

    def init_process_group(backend, **kw):
        seen.update(kw, backend=backend)
        raise _Joined

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
           "TORCHELASTIC_RUN_ID": "test"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = TrainConfig.of(
        model="DiT-S/2", depth=2, hidden_size=32, num_heads=2, image_size=8, vae="none", device="cpu",
        results_dir=str(tmp_path / "run"), dist_timeout_min=45,
    )  # fmt: skip
    with pytest.raises(_Joined):
        train(cfg)
    assert seen["backend"] == "gloo" and seen["timeout"] == timedelta(minutes=45)
    assert TrainConfig.of().runtime.dist_timeout_min == 30  # the default covers an XL/2 save with room to spare
