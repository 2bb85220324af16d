"""The feature networks by name: the scoring networks (Inception-v3, the digit classifier) and the second
judges, whose Fréchet distance is reported beside those FIDs (DINOv2, the digit judge)."""

from __future__ import annotations

import torch

from dit.eval.digit_nets import load_digit_classifier, load_digit_judge
from dit.eval.dinov2 import load_dinov2
from dit.eval.feature_net import FeatureNet
from dit.eval.inception import load_inception
from dit.io.errors import UserError

FEATURE_NETS = ("inception", "mnist", "dinov2", "digit-judge")
JUDGE_PREFIXES = {"dinov2-": "fd_dinov2", "digit-judge-": "fd_judge"}  # a judge's name -> its score's key


def judge_key(network: str) -> str | None:
    """The score a second judge's statistics give (``fd_dinov2``, ``fd_judge``); None for a scoring network."""
    return next((key for prefix, key in JUDGE_PREFIXES.items() if network.startswith(prefix)), None)


def load_feature_net(
    kind: str,
    inception_weights: str | None = None,
    device: str | torch.device = "cpu",
    dinov2_weights: str | None = None,
) -> FeatureNet:
    if kind == "inception":
        return load_inception(inception_weights, device)
    if kind == "mnist":
        return load_digit_classifier(device=device)
    if kind == "dinov2":
        return load_dinov2(dinov2_weights, device)
    if kind == "digit-judge":
        return load_digit_judge(device=device)
    raise UserError(f"unknown feature network {kind!r}: choose one of {', '.join(FEATURE_NETS)}.")


def feature_net_for(
    network: str, inception_weights: str | None = None, device: str | torch.device = "cpu"
) -> FeatureNet:
    """The network a reference was made with, by its recorded name (digits, or Inception from its weights)."""
    if judge_key(network) is not None:
        raise UserError(
            f"the reference holds {network} statistics, a second judge's: pass it as --judge-ref beside the "
            "scoring network's reference (Inception or the digit classifier)."
        )
    return load_feature_net("mnist" if network.startswith("mnist-") else "inception", inception_weights, device)
