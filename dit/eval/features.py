"""Feature networks: what turns images into the vectors the metrics compare.

Every network takes uint8 NCHW images (the pixels the ADM evaluator reads from ``arr_0``), returns a dict of
per-image features (``pool`` for FID and precision/recall, ``logits`` for IS and accuracy, ``spatial`` for
sFID where it has them), carries a ``name`` that identifies architecture *and* weights (reference statistics
record it, so two networks' statistics are never compared), and knows its FLOPs per image, counted once with
FlopCounterMode on the meta device.

Scoring networks: torch-fidelity's TF-compatible Inception-v3 (the ADM evaluator's network, docs/evaluation.md
says why this library) and a small MNIST digit classifier whose committed weights make an offline, CPU-cheap
quality metric for the quick start's digits. Second judges, whose Fréchet distance is reported beside those
FIDs: DINOv2 ViT-L/14 (FD_DINOv2, as dgm-eval and EDM2 compute it) and a self-supervised digit encoder that
no training of the scored models or of the classifier saw (``fd_judge``).
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dit.data.images import to_uint8
from dit.data.store import sha256_file
from dit.io.errors import UserError, require
from dit.runtime.precision import reference

_INCEPTION_PURPOSE = "the Inception features of FID and IS (python -m dit.eval, --eval-every)"

INCEPTION_NAME = "inception-v3-tf-2015-12-05"  # the network behind ADM's reference statistics
# torch hub's integrity convention: the file name ends in the first 8 hex digits of the file's sha256
# (torch-fidelity's weights-inception-2015-12-05-6726825d.pth and pytorch-fid's pt_inception-...-6726825d.pth).
INCEPTION_SHA256_PREFIX = "6726825d"
SFID_CHANNELS = 7  # sFID: the first 7 channels of Mixed_6d.branch1x1 (TF mixed_6/conv) in NHWC order, 17·17·7
DIGIT_WEIGHTS = Path(__file__).parent / "weights" / "mnist_classifier.safetensors"
DIGIT_JUDGE_WEIGHTS = Path(__file__).parent / "weights" / "digits_judge.safetensors"
# its statistics of the 4,000 training digits, written by the same script: embedding them costs seconds on a
# busy 2-core CPU (5 s measured), more than the whole judged evaluation of the quick start's 500 samples
DIGIT_JUDGE_REFERENCE = Path(__file__).parent / "weights" / "digits_judge_reference.npz"
DIGITS_HELD_OUT_PER_CLASS = 100


def _check_nchw(images: torch.Tensor, size: int | None, net: str) -> None:
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise UserError(f"{net} takes NCHW images with 1 or 3 channels, got shape {tuple(images.shape)}.")
    if size is not None and tuple(images.shape[2:]) != (size, size):
        raise UserError(f"{net} takes {size}x{size} images, got {images.shape[2]}x{images.shape[3]}.")


FLOAT_SLACK = 0.5  # a VAE's decode overshoots [-1, 1] a little (the clamp handles it); [0, 255] is far beyond


def _check_float_range(images: torch.Tensor) -> None:
    """Float images must be in [-1, 1]: floats in [0, 255] became all white and floats in [0, 1] a grey
    image set, scored without a word. Generated images reach here as uint8 (the in-loop evaluation quantises
    them as saved samples are), so the test is for images a caller brings; one host sync a batch."""
    low, high = torch.aminmax(images.detach())
    low, high = low.item(), high.item()
    if not (math.isfinite(low) and math.isfinite(high)) or high > 1 + FLOAT_SLACK or low < -1 - FLOAT_SLACK:
        raise UserError(
            f"float images must be in [-1, 1], got values in [{low:g}, {high:g}]: pass uint8 images in [0, 255], "
            "or x / 127.5 - 1."
        )
    if low >= 0 and images.numel() > 1:
        raise UserError(
            f"float images must be in [-1, 1], and this batch has none below 0 ([{low:g}, {high:g}]): images in "
            "[0, 1]? Pass 2 x - 1, or uint8 images in [0, 255]."
        )


class FeatureNet(nn.Module):
    """The interface the evaluator relies on; subclasses set the attributes and implement ``features``."""

    name: str
    pool_dim: int  # FID and precision/recall features
    num_classes: int  # logits (IS); 0 for a judge, which gives pool features only
    spatial_dim: int | None = None  # sFID features, if any
    labels_are_classes: bool = False  # True if logit i is the class a generator's label i asks for (accuracy)
    input_size: int  # the image side the FLOPs are counted at

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if images.is_floating_point():
            _check_float_range(images)
        # IEEE float32, autocast off, in every run's precision: the reference evaluators' arithmetic, so that
        # scores stay comparable (a bf16 or tf32 run's frozen networks are faster; its judges are not).
        with reference(images.device.type):
            return {k: v.float() for k, v in self.features(to_uint8(images)).items()}

    def flops_per_image(self) -> int:
        """Forward FLOPs of one image at ``input_size``, counted on a meta-device copy (no compute, no memory)."""
        meta = copy.deepcopy(self).to("meta")
        example = torch.zeros(1, 3, self.input_size, self.input_size, dtype=torch.uint8, device="meta")
        with FlopCounterMode(display=False) as counter:
            meta.features(example)
        return int(counter.get_total_flops())


# ------------------------------------------------------------------------------------------------------------
# Inception-v3 (torch-fidelity)
# ------------------------------------------------------------------------------------------------------------


def _torch_fidelity_inception(state_dict: dict | None) -> nn.Module:
    """torch-fidelity's TF-compatible Inception-v3 with our weights (``None``: its random initialisation).

    Its constructor always fetches weights itself and unpickles them with ``weights_only=False``; we hand it
    nothing instead and load the state dict that we read safely, so no file is ever unpickled.
    """
    require("torch_fidelity", "eval", _INCEPTION_PURPOSE)
    import torch_fidelity.feature_extractor_inceptionv3 as tfi

    class Inception(tfi.FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, *args, **kwargs):
            return None if state_dict is None else super().load_state_dict(state_dict, *args, **kwargs)

    fetch, tfi.load_state_dict_from_url = tfi.load_state_dict_from_url, lambda *args, **kwargs: None
    try:
        net = Inception("inception-v3-compat", ["2048", "logits_unbiased"])
    finally:
        tfi.load_state_dict_from_url = fetch
    if state_dict is not None:
        try:
            net.load_state_dict(state_dict)
        except RuntimeError as e:
            raise UserError(
                f"the Inception weights do not fit torch-fidelity's Inception-v3 ({str(e).splitlines()[0]}). Pass "
                "--inception-weights weights-inception-2015-12-05-6726825d.pth (torch-fidelity's or pytorch-fid's)."
            ) from None
    return net


class InceptionFeatures(FeatureNet):
    """ADM's three read-outs of Inception-v3 on the TF1-resized 299 px image: pool3 (2048), unbiased logits
    (1008, pool3 · Wᵀ without the bias, for IS) and the sFID slice of Mixed_6d.branch1x1 (2023)."""

    pool_dim, num_classes, spatial_dim, input_size = 2048, 1008, 17 * 17 * SFID_CHANNELS, 299

    def __init__(self, state_dict: dict | None, name: str):
        super().__init__()
        self.name = name
        self.net = _torch_fidelity_inception(state_dict)
        self._spatial: torch.Tensor | None = None
        self.net.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)

    def _keep_spatial(self, module, inputs, output):
        # NHWC order, then the first 7 channels: slicing NCHW instead was the bug that gave sFID 299 in a port.
        self._spatial = output.permute(0, 2, 3, 1)[..., :SFID_CHANNELS].flatten(1)

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_nchw(images_uint8, None, "Inception-v3")
        if images_uint8.shape[1] == 1:
            images_uint8 = images_uint8.expand(-1, 3, -1, -1)
        pool, logits = self.net(images_uint8)
        spatial, self._spatial = self._spatial, None
        return {"pool": pool, "logits": logits, "spatial": spatial}


def _read_state_dict(path: str, flag: str) -> dict:
    """A state dict from .safetensors or a torch file, never unpickling anything but tensors."""
    try:
        if path.endswith(".safetensors"):
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(
            f"cannot read {flag} {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}."
        ) from e


def _download_inception() -> str:
    """torch-fidelity's weights into torch hub's cache (where its own loader keeps them), checked by hash."""
    require("torch_fidelity", "eval", _INCEPTION_PURPOSE)
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(URL_INCEPTION_V3))
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            torch.hub.download_url_to_file(
                URL_INCEPTION_V3, path, hash_prefix=INCEPTION_SHA256_PREFIX, progress=False
            )
        except Exception as e:
            raise UserError(
                f"cannot download the Inception weights ({type(e).__name__}); offline, pass --inception-weights "
                f"FILE with {os.path.basename(URL_INCEPTION_V3)}."
            ) from None
    return path


def load_inception(weights: str | None = None, device: str | torch.device = "cpu") -> InceptionFeatures:
    """Inception-v3 with the TF 2015-12-05 weights (downloaded if ``weights`` is None) or the given file.

    Its name is ADM's network only if the file's sha256 starts with the published prefix; any other file is
    named by its own hash, so statistics made with it never meet ADM's.
    """
    if weights is not None and not os.path.isfile(weights):
        raise UserError(f"--inception-weights {weights}: no such file.")
    path = weights if weights is not None else _download_inception()
    sha = sha256_file(path)
    name = INCEPTION_NAME if sha.startswith(INCEPTION_SHA256_PREFIX) else f"inception-v3-compat-sha256:{sha[:16]}"
    net = InceptionFeatures(_read_state_dict(path, "--inception-weights"), name)
    return net.to(device).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------------------
# MNIST digit classifier
# ------------------------------------------------------------------------------------------------------------


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


def digit_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices into MNIST-5k: per class, the last 100 digits are held out, the rest (400)
    train the classifier and make the reference. The file is sorted by class, so the last 1,000 of the whole
    file would be only 8s and 9s."""
    held_out = np.concatenate(
        [np.flatnonzero(labels == c)[-DIGITS_HELD_OUT_PER_CLASS:] for c in np.unique(labels)]
    )
    train = np.setdiff1d(np.arange(len(labels)), held_out)
    return train, np.sort(held_out)


def digits_to_input(images_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 NCHW (1 or 3 equal channels, as the sampler writes digits) to the classifier's grey [-1, 1]."""
    return images_uint8.float().mean(dim=1, keepdim=True).div(127.5).sub(1.0)


class DigitFeatures(FeatureNet):
    """The digit classifier as a feature network: 64-d features for FID and P/R, its softmax for IS and
    class accuracy (its classes are the digits a class-conditional model is asked for)."""

    pool_dim, num_classes, labels_are_classes, input_size = 64, 10, True, 28

    def __init__(self, classifier: DigitClassifier, name: str):
        super().__init__()
        self.name, self.classifier = name, classifier

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_nchw(images_uint8, 28, "the digit classifier")
        pool = self.classifier.embed(digits_to_input(images_uint8))
        return {"pool": pool, "logits": self.classifier.head(F.relu(pool))}


def load_digit_classifier(
    path: str | os.PathLike = DIGIT_WEIGHTS, device: str | torch.device = "cpu"
) -> DigitFeatures:
    """The committed classifier (scripts/train_digit_classifier.py made it), named by its file's sha256."""
    path = str(path)
    if not os.path.isfile(path):
        raise UserError(
            f"digit classifier weights {path} are missing: run `python scripts/train_digit_classifier.py`."
        )
    classifier = DigitClassifier()
    classifier.load_state_dict(_read_state_dict(path, "digit classifier weights"))
    net = DigitFeatures(classifier, f"mnist-cnn-sha256:{sha256_file(path)[:16]}")
    return net.to(device).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------------------
# The digit judge: self-supervised, trained on the held-out digits only
# ------------------------------------------------------------------------------------------------------------


class DigitJudge(nn.Module):
    """A 28x28 digit encoder trained without labels (SimCLR, scripts/train_digit_judge.py) on the 1,000
    held-out digits: three conv stages, global average pooling, a 64-d feature layer (the FD features) and a
    projection head that only the contrastive loss sees. Another architecture, split and objective than the
    classifier's, so that the two judges do not share a feature space by construction."""

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
        _check_nchw(images_uint8, 28, "the digit judge")
        return {"pool": self.judge.embed(digits_to_input(images_uint8))}


def load_digit_judge(
    path: str | os.PathLike = DIGIT_JUDGE_WEIGHTS, device: str | torch.device = "cpu"
) -> DigitJudgeFeatures:
    """The committed judge (scripts/train_digit_judge.py made it), named by its file's sha256."""
    path = str(path)
    if not os.path.isfile(path):
        raise UserError(f"digit judge weights {path} are missing: run `python scripts/train_digit_judge.py`.")
    judge = DigitJudge()
    judge.load_state_dict(_read_state_dict(path, "digit judge weights"))
    net = DigitJudgeFeatures(judge, f"digit-judge-sha256:{sha256_file(path)[:16]}")
    return net.to(device).eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------------------
# DINOv2 ViT-L/14 (FD_DINOv2)
# ------------------------------------------------------------------------------------------------------------

DINOV2_ARCH = "vit_large_patch14_dinov2.lvd142m"
DINOV2_SIZE = 224
DINOV2_WHERE = (
    "timm's vit_large_patch14_dinov2.lvd142m (huggingface.co/timm/vit_large_patch14_dinov2.lvd142m, "
    "model.safetensors) or Meta's https://dl.fbaipublicfiles.com/dinov2/dinov2_vitl14/dinov2_vitl14_pretrain.pth"
)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def create_dinov2(arch: str = DINOV2_ARCH) -> nn.Module:
    """timm's DINOv2 ViT at 224 px without a head, randomly initialised (tests use it so; a real file is
    loaded by ``load_dinov2``)."""
    from dit.io.errors import require

    timm = require("timm", "repa", "FD_DINOv2 (--dinov2-weights)")
    return timm.create_model(arch, pretrained=False, num_classes=0, img_size=DINOV2_SIZE)


def _dinov2_pos_embed(pos_embed: torch.Tensor, grid: int) -> torch.Tensor:
    """The 518 px checkpoint's position embeddings at ``grid`` x ``grid`` patches, as DINOv2's own
    ``interpolate_pos_encoding`` does it on every forward of the hub model dgm-eval runs: bicubic, no
    antialiasing, scale factor (grid + 0.1) / old grid; the class token's embedding kept as it is."""
    cls, patches = pos_embed[:, :1], pos_embed[:, 1:]
    old = math.isqrt(patches.shape[1])
    if old == grid:
        return pos_embed
    x = patches.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    scale = (grid + 0.1) / old
    x = F.interpolate(x, scale_factor=(scale, scale), mode="bicubic", antialias=False)
    return torch.cat([cls, x.permute(0, 2, 3, 1).reshape(1, grid * grid, -1).to(pos_embed.dtype)], dim=1)


class DINOv2Features(FeatureNet):
    """DINOv2's CLS token after the final LayerNorm (1024-d for ViT-L/14), dgm-eval's FD_DINOv2 features.

    The semantics matched are dgm-eval's (layer6ai-labs/dgm-eval, dgm_eval/models/dinov2.py, read, not
    copied): the image resized to 224x224 with bicubic interpolation on the uint8 image (PIL there, torchvision's
    uint8 kernel here, with antialiasing as PIL has; within 2 grey levels of PIL), scaled to [0, 1], normalised
    with ImageNet's mean and std, and the hub model's output, which is the normalised CLS token. Grey images
    are repeated to RGB."""

    num_classes, input_size = 0, DINOV2_SIZE

    def __init__(self, model: nn.Module, name: str):
        super().__init__()
        self.name, self.model, self.pool_dim = name, model, model.embed_dim
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2.functional import resize

        _check_nchw(images_uint8, None, "DINOv2")
        if images_uint8.shape[1] == 1:
            images_uint8 = images_uint8.expand(-1, 3, -1, -1)
        if tuple(images_uint8.shape[2:]) != (DINOV2_SIZE, DINOV2_SIZE):
            size = [DINOV2_SIZE, DINOV2_SIZE]
            images_uint8 = resize(images_uint8, size, InterpolationMode.BICUBIC, antialias=True)
        x = (images_uint8.float() / 255 - self.mean) / self.std
        return {"pool": self.model.forward_features(x)[:, 0]}


def load_dinov2(
    weights: str | None, device: str | torch.device = "cpu", arch: str = DINOV2_ARCH
) -> DINOv2Features:
    """DINOv2 with the weights in ``weights`` (timm's or Meta's layout, .safetensors or .pth, read with
    weights_only), named by the file's sha256 so statistics of other weights never meet."""
    if weights is None or not os.path.isfile(weights):
        given = f" {weights}: no such file" if weights is not None else " is needed"
        raise UserError(f"--dinov2-weights{given}. FD_DINOv2 runs offline from a weights file: {DINOV2_WHERE}.")
    from timm.models.vision_transformer import checkpoint_filter_fn

    model = create_dinov2(arch)
    state = _read_state_dict(weights, "--dinov2-weights")
    if "pos_embed" in state:
        state["pos_embed"] = _dinov2_pos_embed(state["pos_embed"], model.patch_embed.grid_size[0])
    try:
        model.load_state_dict(checkpoint_filter_fn(state, model))
    except (RuntimeError, KeyError) as e:
        raise UserError(
            f"--dinov2-weights {weights} does not fit {arch} ({str(e).splitlines()[0][:200]}): pass {DINOV2_WHERE}."
        ) from None
    net = DINOv2Features(model, f"dinov2-{arch}-sha256:{sha256_file(weights)[:16]}")
    return net.to(device).eval().requires_grad_(False)


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
