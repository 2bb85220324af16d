"""Writes tests/data/checkpoint_v1/: a training run of the configuration format before sections (dit-ledger a78d155)."""

import shutil
from pathlib import Path

import torch

from dit.train import TrainConfig, train


class Pixels(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.rand(3, 8, 8, generator=g) * 2 - 1, i % 2


out = Path("/tmp/oldck/run")
shutil.rmtree(out, ignore_errors=True)
cfg = TrainConfig(
    model="DiT-S/4",
    depth=1,
    hidden_size=16,
    num_heads=2,
    patch_size=4,
    image_size=8,
    num_classes=2,
    vae="none",
    global_batch_size=4,
    max_steps=2,
    log_every=1,
    ckpt_every=1,
    keep_last=0,
    num_workers=0,
    precision="fp32",
    results_dir=str(out),
    lr=1e-3,
)
train(cfg, Pixels())
