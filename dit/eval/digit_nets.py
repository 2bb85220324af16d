"""The quick start's digit networks, whose committed weights make an offline, CPU-cheap quality metric:
a small MNIST classifier (the scoring network: FID features, IS, class accuracy) and a self-supervised digit
encoder that no training of the scored models or of the classifier saw (the second judge, ``fd_judge``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dit.data.store import sha256_file
from dit.eval.feature_net import FeatureNet, check_nchw, read_state_dict
from dit.io.errors import UserError

WEIGHTS = Path(__file__).parent / "weights"
DIGIT_WEIGHTS = WEIGHTS / "mnist_classifier.safetensors"
DIGIT_JUDGE_WEIGHTS = WEIGHTS / "digits_judge.safetensors"
# its statistics of the 4,000 training digits, written by the same script so that no evaluation embeds them
DIGIT_JUDGE_REFERENCE = WEIGHTS / "digits_judge_reference.npz"


class DigitClassifier(nn.Module):
    """A 28x28 digit CNN: two conv-pool stages, a 64-d feature layer (the FID features, taken before the
    ReLU so no unit is stuck at 0 and 1,000 images give a full-rank covariance), a 10-way head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 7 * 7, 64)
        self.head = nn.Linear(64, 10)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """64-d features of images in [-1, 1], shape (N, 1, 28, 28)."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.embed(x)))


def digits_to_input(images_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW (1 or 3 equal channels, as the sampler writes digits) to the classifier's grey [-1, 1]."""
    return images_uint8.float().mean(dim=1, keepdim=True).div(127.5).sub(1.0)


class DigitFeatures(FeatureNet):
    """The digit classifier as a feature network: 64-d features for FID and P/R, logits for IS and accuracy."""

    pool_dim, num_classes, labels_are_classes, input_size = 64, 10, True, 28

    def __init__(self, classifier: DigitClassifier, name: str):
        super().__init__()
        self.name, self.classifier = name, classifier

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        check_nchw(images_uint8, 28, "the digit classifier")
        pool = self.classifier.embed(digits_to_input(images_uint8))
        return {"pool": pool, "logits": self.classifier.head(F.relu(pool))}


def load_digit_classifier(
    path: str | os.PathLike = DIGIT_WEIGHTS, device: str | torch.device = "cpu"
) -> DigitFeatures:
    """The committed classifier (studies/train_digit_classifier.py made it), named by its file's sha256."""
    return _committed(
        path, "digit classifier", "train_digit_classifier", DigitClassifier(), DigitFeatures, "mnist-cnn", device
    )


def _committed(path, what: str, script: str, module: nn.Module, feature_net: type, prefix: str, device):
    """``module`` with the committed weights at ``path`` (``studies/{script}.py`` made them) as ``feature_net``,
    named ``prefix`` and the file's sha256."""
    path = str(path)
    if not os.path.isfile(path):
        raise UserError(f"{what} weights {path} are missing: run `python studies/{script}.py`.")
    module.load_state_dict(read_state_dict(path, f"{what} weights"))
    net = feature_net(module, f"{prefix}-sha256:{sha256_file(path)[:16]}")
    return net.to(device).eval().requires_grad_(False)


class DigitJudge(nn.Module):
    """A 28x28 digit encoder trained without labels (SimCLR, studies/train_digit_judge.py) on the 1,000 held-out
    digits: another architecture, split and objective than the classifier's, so the judges share no features."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64, 64)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(64, 64))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """64-d features of images in [-1, 1], shape (N, 1, 28, 28)."""
        x = F.avg_pool2d(F.relu(self.conv1(x)), 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(F.relu(self.conv3(x)).mean(dim=(2, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


class DigitJudgeFeatures(FeatureNet):
    """The digit judge as a feature network: 64-d pool features, no logits."""

    pool_dim, num_classes, input_size = 64, 0, 28

    def __init__(self, judge: DigitJudge, name: str):
        super().__init__()
        self.name, self.judge = name, judge

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        check_nchw(images_uint8, 28, "the digit judge")
        return {"pool": self.judge.embed(digits_to_input(images_uint8))}


def load_digit_judge(
    path: str | os.PathLike = DIGIT_JUDGE_WEIGHTS, device: str | torch.device = "cpu"
) -> DigitJudgeFeatures:
    """The committed judge (studies/train_digit_judge.py made it), named by its file's sha256."""
    return _committed(
        path, "digit judge", "train_digit_judge", DigitJudge(), DigitJudgeFeatures, "digit-judge", device
    )
