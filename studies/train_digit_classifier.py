"""Train the digit classifier behind the MNIST FID (dit/eval/weights/mnist_classifier.safetensors).

    python studies/train_digit_classifier.py

Deterministic: one thread, a fixed seed and deterministic kernels give the same bytes on every run (the file's
sha256 names the network in every statistics file made with it). Trains on the 4,000 training digits of
MNIST-5k (``dit.data.digits.digit_split``) with shifts of up to 2 pixels for 30 epochs, and reports the accuracy on the
1,000 held-out digits, which docs/evaluation.md records.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dit.eval.digit_nets import DIGIT_WEIGHTS, DigitClassifier
from dit.io.cli import run_cli
from dit.io.config import Section, option
from dit.io.face import Face
from seeded import command, digits, report, save_weights, seeded_script, train_epochs


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
    x_train, y_train, x_held, y_held = digits()

    model = DigitClassifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps = args.epochs * -(-len(x_train) // args.batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    loss_of = lambda batch: F.cross_entropy(model(shifted(x_train[batch], generator)), y_train[batch])  # noqa: E731
    start = time.perf_counter()
    for epoch, loss, _ in train_epochs(model, optimizer, schedule, loss_of, len(x_train), args, generator):
        print(f"epoch {epoch}/{args.epochs}: loss {loss:.4f}, held-out accuracy "
              f"{accuracy(model, x_held, y_held):.2%}", file=sys.stderr)  # fmt: skip
    seconds = time.perf_counter() - start

    result = {
        "command": command("train_digit_classifier.py", argv),
        "train_images": len(x_train),
        "held_out_images": len(x_held),
        "train_accuracy": accuracy(model, x_train, y_train),
        "held_out_accuracy": accuracy(model, x_held, y_held),
        "parameters": sum(t.numel() for t in model.parameters()),
        "epochs": args.epochs,
        "seconds": round(seconds, 1),
    }
    result["sha256"] = save_weights(model, out)
    return report(result, args.report)


if __name__ == "__main__":
    sys.exit(run_cli(main))
