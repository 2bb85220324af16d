"""Train the digit judge, the second judge of the quick start's digits (dit/eval/weights/digits_judge.safetensors).

    python studies/train_digit_judge.py --report dit/eval/weights/digits_judge.json

Self-supervised: SimCLR's NT-Xent loss (Chen et al. 2020) on two random affine views of each digit, no labels,
on the 1,000 held-out digits of MNIST-5k (``dit.data.digits.digit_split``) that neither the classifier nor
the digit reference uses. Deterministic: one thread, fixed seeds and deterministic kernels write the same bytes
on every run (the file's sha256 names the judge in every statistics file). The labels are read only for a
figure of the report: the 1-nearest-neighbour accuracy of the 4,000 training digits against the 1,000.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dit.eval.digit_nets import DIGIT_JUDGE_REFERENCE, DIGIT_JUDGE_WEIGHTS, DigitJudge, load_digit_judge
from dit.eval.metrics import frechet_distance, mean_cov
from dit.eval.reference import digits_reference, save_stats
from dit.io.cli import run_cli
from dit.io.config import Section, option
from dit.io.face import Face
from seeded import command, digits, report, save_weights, seeded_script


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random view of each digit in [-1, 1]: rotation up to 15 degrees, scale 0.85-1.15, shift up to 3 pixels,
    and half the time an 8x8 patch blanked (so that no single stroke identifies a digit)."""
    n = len(x)
    u = torch.rand(n, 5, generator=generator)
    angle = (u[:, 0] * 2 - 1) * math.radians(15)
    scale = 0.85 + 0.3 * u[:, 1]
    shift = (u[:, 2:4] * 2 - 1) * (3 / 14)  # 3 pixels in affine_grid's [-1, 1] coordinates
    cos, sin = angle.cos() / scale, angle.sin() / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    view = F.grid_sample(x + 1, grid, align_corners=False) - 1  # background -1 outside the digit's frame
    corner = torch.randint(0, 21, (n, 2), generator=generator).tolist()
    for i, (row, col) in enumerate(corner):
        if u[i, 4] < 0.5:
            view[i, :, row : row + 8, col : col + 8] = -1.0
    return view


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's loss: each view must pick its partner among the other 2N - 1 views by cosine similarity."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    logits = z @ z.T / temperature
    logits.fill_diagonal_(float("-inf"))
    n = len(z1)
    partner = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(logits, partner)


def embed(model: DigitJudge, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model.embed(part) for part in x.split(500)])


@dataclass(frozen=True)
class JudgeConfig(Section):
    """The digit judge's training run."""

    out: str | None = option(None, "the weights file (safetensors); none: the committed one")
    reference_out: str | None = option(None, "its statistics of the training digits; none: the committed ones")
    steps: int = option(1000, "training steps", ge=1)
    batch_size: int = option(128, "digits per step", ge=2)
    lr: float = option(2e-3, "Adam's learning rate", gt=0)
    temperature: float = option(0.2, "NT-Xent's temperature", gt=0)
    seed: int = option(0, "the seed of the weights, the augmentations and the order")
    report: str | None = option(None, "also write the run's figures to this JSON file")


FACE = Face("studies/train_digit_judge.py", __doc__, sections={"train": JudgeConfig},
            outputs={"out": "file", "reference_out": "file", "report": "file"})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = FACE.parse(argv).sections["train"]
    out = args.out or str(DIGIT_JUDGE_WEIGHTS)

    generator = seeded_script(args.seed)
    x_train, y_train, x_held, y_held = digits()

    model = DigitJudge()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    losses, flops = [], 0
    start = time.perf_counter()
    for step in range(args.steps):
        batch = torch.randperm(len(x_held), generator=generator)[: args.batch_size]
        x = x_held[batch]
        with FlopCounterMode(display=False) as counter:
            loss = nt_xent(model(augment(x, generator)), model(augment(x, generator)), args.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        flops += counter.get_total_flops()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == args.steps:
            print(f"step {step + 1}/{args.steps}: loss {np.mean(losses[-50:]):.4f}", file=sys.stderr)
    seconds = time.perf_counter() - start

    model.eval()
    f_held, f_train = embed(model, x_held), embed(model, x_train)
    nearest = torch.cdist(f_train, f_held).argmin(dim=1)
    noise = torch.randn(1000, 1, 28, 28, generator=generator).mul(0.5).clamp(-1, 1)
    ref = mean_cov(f_train.double().numpy())
    result = {
        "command": command("train_digit_judge.py", argv),
        "seed": args.seed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "temperature": args.temperature,
        "train_images": len(x_held),
        "labels_used_for_training": False,
        "final_loss": float(np.mean(losses[-50:])),
        "first_loss": losses[0],
        "parameters": sum(t.numel() for t in model.parameters()),
        "train_flops": flops,
        "seconds": round(seconds, 1),
        "knn1_accuracy_train_vs_held_out": (y_held[nearest] == y_train).double().mean().item(),
        "fd_held_out_vs_train": frechet_distance(*mean_cov(f_held.double().numpy()), *ref).value,
        "fd_noise_vs_train": frechet_distance(*mean_cov(embed(model, noise).double().numpy()), *ref).value,
    }
    result["sha256"] = save_weights(model, out)
    reference = digits_reference(load_digit_judge(out))  # the saved weights, named as evaluations name them
    reference.features = None  # mu and sigma are all a judge needs
    save_stats(args.reference_out or str(DIGIT_JUDGE_REFERENCE), reference)
    return report(result, args.report)


if __name__ == "__main__":
    sys.exit(run_cli(main))
