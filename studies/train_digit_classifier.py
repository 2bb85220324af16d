"""Train the digit classifier behind the MNIST FID (dit/eval/weights/mnist_classifier.safetensors).

    python studies/train_digit_classifier.py

Deterministic: one thread, a fixed seed and deterministic kernels give the same bytes on every run (the file's
sha256 names the network in every statistics file made with it). Trains on the 4,000 training digits of
MNIST-5k (``dit.data.digits.digit_split``) with shifts of up to 2 pixels for 30 epochs, and reports the accuracy on the
1,000 held-out digits, which docs/evaluation.md records.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import save

from dit.data.digits import digit_split, load_mnist_5k
from dit.data.store import sha256_file
from dit.eval.digit_nets import DIGIT_WEIGHTS, DigitClassifier, digits_to_input
from dit.io.atomic import atomic_write, atomic_write_bytes
from dit.io.cli import run_cli
from dit.io.config import Section, option
from dit.io.face import Face
from seeded import seeded_script


def shifted(x: torch.Tensor, generator: torch.Generator, max_shift: int = 2) -> torch.Tensor:
    """Each image moved by up to ``max_shift`` pixels in x and y (zero fill): the augmentation."""
    padded = F.pad(x, [max_shift] * 4, value=-1.0)
    offsets = torch.randint(0, 2 * max_shift + 1, (len(x), 2), generator=generator).tolist()
    size = x.shape[-1]
    return torch.stack([padded[i, :, dy : dy + size, dx : dx + size] for i, (dy, dx) in enumerate(offsets)])


def accuracy(model: DigitClassifier, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


@dataclass(frozen=True)
class ClassifierConfig(Section):
    """The digit classifier's training run."""

    out: str | None = option(None, "the weights file (safetensors); none: the committed one")
    epochs: int = option(30, "passes over the training digits", ge=1)
    batch_size: int = option(64, "digits per step", ge=1)
    lr: float = option(1e-3, "Adam's learning rate", gt=0)
    seed: int = option(0, "the seed of the weights and of the order")
    report: str | None = option(None, "also write the run's figures to this JSON file")


FACE = Face("studies/train_digit_classifier.py", __doc__, sections={"train": ClassifierConfig},
            outputs={"out": "file", "report": "file"})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = FACE.parse(argv).sections["train"]
    out = args.out or str(DIGIT_WEIGHTS)

    generator = seeded_script(args.seed)

    images, labels = load_mnist_5k()
    train, held_out = digit_split(labels)
    to_x = lambda idx: digits_to_input(torch.from_numpy(images[idx]).unsqueeze(1))  # noqa: E731
    x_train, y_train = to_x(train), torch.from_numpy(labels[train])
    x_held, y_held = to_x(held_out), torch.from_numpy(labels[held_out])

    model = DigitClassifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps = args.epochs * -(-len(train) // args.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(train), generator=generator)
        for batch in order.split(args.batch_size):
            loss = F.cross_entropy(model(shifted(x_train[batch], generator)), y_train[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
        model.eval()
        print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}, held-out accuracy "
              f"{accuracy(model, x_held, y_held):.2%}", file=sys.stderr)  # fmt: skip
    seconds = time.perf_counter() - start

    model.eval()
    result = {
        "command": "python studies/train_digit_classifier.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "train_images": len(train),
        "held_out_images": len(held_out),
        "train_accuracy": accuracy(model, x_train, y_train),
        "held_out_accuracy": accuracy(model, x_held, y_held),
        "parameters": sum(t.numel() for t in model.parameters()),
        "epochs": args.epochs,
        "seconds": round(seconds, 1),
    }
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    atomic_write_bytes(out, save(state))
    result["sha256"] = sha256_file(out)
    if args.report:
        atomic_write(args.report, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
