"""Train REPA's digit encoder, ``digits-mae`` (dit/data/weights/digits_mae.safetensors), without labels.

    python studies/train_digit_encoder.py

The digit FID's classifier must not be REPA's teacher, so this is another network trained another way: the
timm ViT of ``dit.data.encoder.LOCAL_ENCODERS["digits-mae"]`` (patch 4 on 28x28: the quick start's 7x7 token grid)
as a masked autoencoder (He et al. 2021, reimplemented from the paper): 75% of the patches hidden, the
encoder sees the rest, a small decoder (discarded) predicts the hidden patches' pixels, normalised per patch.
On the 4,000 training digits of MNIST-5k (``dit.data.digits.digit_split``), no labels. Deterministic: one
thread, fixed seeds, deterministic kernels. The JSON beside the weights records the command, the time and the
training FLOPs (FlopCounterMode over a real step: an upstream cost REPA's x axis adds), and a linear probe on
the held-out digits (the only use of labels, to show the features carry the digit).
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models.vision_transformer import Block
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dit.cost.analytic import vit_forward_macs
from dit.cost.measured import CPU_SDPA_FORMULAS
from dit.data.encoder import LOCAL_ENCODERS, create_encoder_model, vit_shape
from dit.io.cli import run_cli
from dit.io.config import Section, option
from dit.io.face import Face
from dit.model.layers import sincos_2d
from seeded import command, digits, report, save_weights, seeded_script, train_epochs

NAME = "digits-mae"


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, T, p * p * C) in the patch embedding's row-major token order."""
    n, c, h, w = images.shape
    x = images.reshape(n, c, h // p, p, w // p, p)
    return torch.einsum("nchpwq->nhwpqc", x).reshape(n, (h // p) * (w // p), p * p * c)


class MaskedAutoencoder(nn.Module):
    """The timm encoder on the visible patches (with its class token), and a narrow decoder on all of them."""

    def __init__(self, encoder: nn.Module, decoder_dim: int = 64, decoder_depth: int = 2, decoder_heads: int = 2):
        super().__init__()
        self.encoder = encoder
        shape = vit_shape(encoder)
        self.patch, self.grid = shape.patch_size, shape.grid
        self.embed = nn.Linear(shape.width, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        table = torch.from_numpy(sincos_2d(decoder_dim, self.grid)).float()
        self.register_buffer("pos", torch.cat([torch.zeros(1, decoder_dim), table]).unsqueeze(0), persistent=False)
        self.blocks = nn.Sequential(
            *[Block(decoder_dim, decoder_heads, mlp_layer=Mlp) for _ in range(decoder_depth)]
        )
        self.norm = nn.LayerNorm(decoder_dim)
        self.head = nn.Linear(decoder_dim, self.patch**2 * shape.in_channels)
        nn.init.normal_(self.mask_token, std=0.02)

    def encode(self, images: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Class token + the kept patches (indices ``keep`` (N, K)) through the encoder's blocks and norm."""
        enc, prefix = self.encoder, self.encoder.num_prefix_tokens
        x = enc.patch_embed(images) + enc.pos_embed[:, prefix:]
        x = torch.gather(x, 1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        cls = (enc.cls_token + enc.pos_embed[:, :prefix]).expand(len(x), -1, -1)
        return enc.norm(enc.blocks(enc.norm_pre(torch.cat([cls, x], dim=1))))

    def forward(self, images: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Mean squared error of the predicted pixels of the hidden patches (normalised per patch)."""
        n, tokens = len(images), self.grid**2
        latent = self.embed(self.encode(images, keep))
        full = self.mask_token.expand(n, tokens, -1).clone()
        full.scatter_(1, keep.unsqueeze(-1).expand(-1, -1, full.shape[-1]), latent[:, 1:])
        x = torch.cat([latent[:, :1], full], dim=1) + self.pos
        pred = self.head(self.norm(self.blocks(x)))[:, 1:]
        target = patchify(images, self.patch)
        target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6).sqrt()
        hidden = torch.ones(n, tokens, device=images.device).scatter_(1, keep, 0.0)
        return (((pred - target) ** 2).mean(-1) * hidden).sum() / hidden.sum()


def random_keep(n: int, tokens: int, keep: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(n, tokens, generator=generator).argsort(dim=1)[:, :keep]


@torch.no_grad()
def pooled_features(encoder: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mean patch token of every image (no masking), as REPA's targets come from the unmasked encoder."""
    out = [encoder.forward_features(b)[:, encoder.num_prefix_tokens :].mean(1) for b in x.split(500)]
    return torch.cat(out)


def probe_accuracy(train_x, train_y, test_x, test_y, ridge: float = 1e-2) -> float:
    """A closed-form ridge regression onto one-hot labels: how linearly the features separate the digits."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    a, test = (torch.cat([(x - mean) / std, torch.ones(len(x), 1)], 1).double() for x in (train_x, test_x))
    b = F.one_hot(train_y, 10).double()
    w = torch.linalg.solve(a.T @ a + ridge * len(a) * torch.eye(a.shape[1], dtype=a.dtype), a.T @ b)
    return ((test @ w).argmax(1) == test_y).double().mean().item()


@dataclass(frozen=True)
class EncoderConfig(Section):
    """The digit encoder's training run."""

    out: str | None = option(None, "the weights file, its JSON report beside it; none: the committed one")
    epochs: int = option(20, "passes over the training digits", ge=1)
    batch_size: int = option(128, "digits per step", ge=1)
    lr: float = option(1.5e-3, "AdamW's learning rate", gt=0)
    mask_ratio: float = option(0.75, "the share of patches hidden", gt=0, lt=1)
    seed: int = option(0, "the seed of the weights, the masks and the order")


FACE = Face("studies/train_digit_encoder.py", __doc__, sections={"train": EncoderConfig}, outputs={"out": "file"})


def main(argv: list[str] | None = None) -> int:
    local = LOCAL_ENCODERS[NAME]
    args = FACE.parse(argv).sections["train"]
    out = args.out or str(local.weights)

    generator = seeded_script(args.seed)
    x_train, y_train, x_held, y_held = digits()  # [-1, 1]: mean 0.5, std 0.5 of [0, 1]

    encoder = create_encoder_model(NAME)
    mae = MaskedAutoencoder(encoder)
    tokens = mae.grid**2
    keep = max(1, round(tokens * (1 - args.mask_ratio)))
    decay = [q for n, q in mae.named_parameters() if q.ndim > 1 and "pos_embed" not in n and "token" not in n]
    rest = [q for n, q in mae.named_parameters() if not (q.ndim > 1 and "pos_embed" not in n and "token" not in n)]
    groups = [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    per_epoch = math.ceil(len(x_train) / args.batch_size)
    steps = args.epochs * per_epoch
    warmup = min(2 * per_epoch, max(1, steps // 10))

    def lr_factor(s: int) -> float:  # linear warm-up, then a cosine to 0
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    # The training FLOPs: one real step of one image counted (forward and backward, the CPU attention kernel
    # with the formulas torch uses for fused kernels), times the images trained on; every step has the same
    # shapes per image. Counted on a copy, so the run itself is untouched.
    probe = copy.deepcopy(mae)
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FORMULAS) as counter:
        probe(x_train[:1], random_keep(1, tokens, keep, torch.Generator().manual_seed(0))).backward()
    flops_per_image = counter.get_total_flops()
    del probe

    loss_of = lambda batch: mae(x_train[batch], random_keep(len(batch), tokens, keep, generator))  # noqa: E731
    start = time.perf_counter()
    for epoch, _, mean_loss in train_epochs(mae, optimizer, schedule, loss_of, len(x_train), args, generator):
        print(f"epoch {epoch}/{args.epochs}: loss {mean_loss:.4f}", file=sys.stderr)
    seconds = time.perf_counter() - start

    shape = vit_shape(encoder)
    probe_mae = probe_accuracy(
        pooled_features(encoder, x_train), y_train, pooled_features(encoder, x_held), y_held
    )
    probe_pixels = probe_accuracy(x_train.flatten(1), y_train, x_held.flatten(1), y_held)
    sha256 = save_weights(encoder, out)
    result = {
        "command": command("train_digit_encoder.py", argv),
        "encoder": NAME,
        "architecture": local.architecture,
        "kwargs": local.kwargs,
        "objective": f"masked autoencoding, {args.mask_ratio:.0%} of {tokens} patches hidden, per-patch normalised pixels",
        "train_images": len(x_train),
        "labels_used": "none in training; the held-out linear probe only",
        "parameters": sum(t.numel() for t in encoder.parameters()),
        "decoder_parameters_discarded": sum(t.numel() for t in mae.parameters())
        - sum(t.numel() for t in encoder.parameters()),
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "final_loss": mean_loss,
        "seconds": round(seconds, 1),
        "threads": 1,
        "train_flops_per_image": flops_per_image,
        "train_flops": flops_per_image * len(x_train) * args.epochs,
        "encoder_forward_flops_per_image": 2 * vit_forward_macs(shape),
        "linear_probe_held_out_accuracy": probe_mae,
        "linear_probe_pixels_held_out_accuracy": probe_pixels,
        "sha256": sha256,
    }
    return report(result, local.report if args.out is None else out.removesuffix(".safetensors") + ".json")


if __name__ == "__main__":
    sys.exit(run_cli(main))
