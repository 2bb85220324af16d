"""What the studies share: their command lines and JSON outputs; and, for the scripts that train the digit networks
(classifier, judge, MAE encoder), their determinism, their digits, their training loop and their weights files."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save
from torch import nn

from dit.data.digits import digit_split, load_mnist_5k
from dit.data.store import sha256_file
from dit.eval.digit_nets import digits_to_input
from dit.io.atomic import atomic_write_bytes


def seeded_script(seed: int) -> torch.Generator:
    """One thread, deterministic kernels and the seed (the same bytes every run on one machine); a generator."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MNIST-5k's training digits in [-1, 1] (N, 1, 28, 28), their labels, and the held-out digits and labels."""
    images, labels = load_mnist_5k()
    train, held_out = digit_split(labels)
    x, y = digits_to_input(torch.from_numpy(images).unsqueeze(1)), torch.from_numpy(labels)
    return x[train], y[train], x[held_out], y[held_out]


def train_epochs(
    model: nn.Module, optimizer, schedule, loss_of: Callable, n: int, args, generator: torch.Generator
) -> Iterator[tuple[int, float, float]]:
    """``args.epochs`` passes over ``n`` digits in new orders, a step on ``loss_of(indices)`` per batch; yields after
    each (the model in eval mode) the pass's number, its last batch's loss and its mean loss."""
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for batch in torch.randperm(n, generator=generator).split(args.batch_size):
            loss = loss_of(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item() * len(batch)
        model.eval()
        yield epoch + 1, loss.item(), total / n


def save_weights(model: nn.Module, out: str) -> str:
    """The weights as safetensors at ``out``; their sha256, which names the network wherever it is used."""
    atomic_write_bytes(out, save({k: v.contiguous() for k, v in model.state_dict().items()}))
    return sha256_file(out)


def command(script: str, argv: list[str] | None) -> str:
    return f"python studies/{script} " + " ".join(argv if argv is not None else sys.argv[1:])


def write_json(path: str | Path, data: dict) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=1) + "\n").encode())


def report(result: dict, path: str | None) -> int:
    """The run's figures on stdout, and as JSON at ``path`` if given."""
    if path:
        write_json(path, result)
    print(json.dumps(result, indent=1))
    return 0
