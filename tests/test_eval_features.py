"""Feature networks (dit/eval/features.py and a module per network): the real Inception-v3 architecture with
random weights (no download), the committed digit classifier, input contracts, FLOP counts and the offline
errors."""

from __future__ import annotations

import copy
import urllib.error
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from dit.data.digits import digit_split, load_mnist_5k
from dit.data.store import sha256_file
from dit.eval.digit_nets import DIGIT_WEIGHTS, load_digit_classifier
from dit.eval.inception import INCEPTION_NAME, load_inception
from dit.io.errors import UserError


@pytest.fixture(scope="module")
def inception(inception_weights):
    return load_inception(inception_weights)


@pytest.fixture(scope="module")
def images():
    return torch.randint(0, 256, (3, 3, 20, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_inception_outputs_adm_shapes_deterministically(inception, inception_weights, images):
    assert inception.name == f"inception-v3-compat-sha256:{sha256_file(inception_weights)[:16]}" != INCEPTION_NAME
    out = inception(images)
    assert {k: tuple(v.shape) for k, v in out.items()} == {
        "pool": (3, 2048),
        "logits": (3, 1008),
        "spatial": (3, 2023),
    }
    assert all(torch.isfinite(v).all() and v.std() > 1e-3 for v in out.values())
    again = inception(images)
    assert all(torch.equal(out[k], again[k]) for k in out)
    one = inception(images[1:2])  # a batch of one gives the same features as within a batch
    torch.testing.assert_close(one["pool"], out["pool"][1:2], rtol=1e-4, atol=1e-5)


def test_a_runs_autocast_does_not_reach_the_evaluation_network(inception, images):
    """Scores stay comparable with the reference evaluators': the judge computes in float32 inside a bf16 run."""
    out = inception(images)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = inception(images)
    assert all(torch.equal(out[k], inside[k]) for k in out)


def test_inception_logits_are_unbiased_and_spatial_is_the_nhwc_slice(inception, images):
    captured = {}
    hook = inception.net.Mixed_6d.branch1x1.register_forward_hook(lambda m, i, o: captured.update(out=o))
    try:
        out = inception(images)
    finally:
        hook.remove()
    fc = inception.net.fc
    assert fc.bias.abs().max() > 0  # so that leaving the bias out is visible
    torch.testing.assert_close(out["logits"], out["pool"] @ fc.weight.T)
    mixed = captured["out"]  # (N, 192, 17, 17); sFID feature (h * 17 + w) * 7 + c is channel c at (h, w)
    assert mixed.shape[1:] == (192, 17, 17)
    for h, w, c in [(0, 0, 0), (0, 0, 6), (0, 1, 0), (5, 11, 3), (16, 16, 6)]:
        torch.testing.assert_close(out["spatial"][:, (h * 17 + w) * 7 + c], mixed[:, c, h, w])


def test_float_images_score_as_their_uint8_files(inception, images):
    as_float = images.float() / 127.5 - 1.0
    out, ref = inception(as_float), inception(images)
    assert all(torch.equal(out[k], ref[k]) for k in out)


def _hook_count(module: nn.Module, example: torch.Tensor, extra: int = 0) -> int:
    """Multiply-adds x 2 of every conv and linear layer that runs, from their output shapes."""
    total = [extra]

    def count(layer, inputs, output):
        if isinstance(layer, nn.Conv2d):
            per_output = layer.in_channels // layer.groups * layer.kernel_size[0] * layer.kernel_size[1]
            total[0] += 2 * output.numel() * per_output
        else:
            total[0] += 2 * output.numel() * layer.in_features

    meta = copy.deepcopy(module).to("meta")
    hooks = [m.register_forward_hook(count) for m in meta.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    meta.features(example.to("meta"))
    for hook in hooks:
        hook.remove()
    return total[0]


def test_flops_per_image_match_a_count_from_layer_shapes(inception):
    example = torch.zeros(1, 3, 299, 299, dtype=torch.uint8)
    # The unbiased logits are a bare matmul with the fc weight, not a call of the fc module: add them.
    expected = _hook_count(inception, example, extra=2 * 2048 * 1008)
    assert inception.flops_per_image() == expected
    digits = load_digit_classifier()
    assert digits.flops_per_image() == _hook_count(digits, torch.zeros(1, 1, 28, 28, dtype=torch.uint8))


def test_inception_weights_errors_name_the_flag(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="--inception-weights .*no such file"):
        load_inception(str(tmp_path / "missing.pth"))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(UserError, match="offline, pass --inception-weights FILE"):
        load_inception(None)

    with pytest.raises(UserError, match="do not fit"):
        load_inception(str(DIGIT_WEIGHTS))

    torch.save({"weight": Fraction(1, 2)}, tmp_path / "pickled.pth")  # a pickle that is not only tensors
    with pytest.raises(UserError, match="cannot read --inception-weights"):
        load_inception(str(tmp_path / "pickled.pth"))


def test_digit_split_holds_out_100_per_class():
    labels = np.repeat(np.arange(10), 500)
    train, held_out = digit_split(labels)
    assert len(train) == 4000 and len(held_out) == 1000 and not set(train) & set(held_out)
    assert np.bincount(labels[held_out]).tolist() == [100] * 10
    assert all(held_out[labels[held_out] == c].min() == 500 * c + 400 for c in range(10))


def test_committed_digit_classifier_is_accurate_with_full_rank_features():
    net = load_digit_classifier()
    assert net.name == f"mnist-cnn-sha256:{sha256_file(DIGIT_WEIGHTS)[:16]}"
    images, labels = load_mnist_5k()
    _, held_out = digit_split(labels)
    x = torch.from_numpy(images[held_out]).unsqueeze(1)
    with torch.no_grad():
        out = net(x)
        rgb = net(x.expand(-1, 3, -1, -1))  # the sampler writes digits as 3 equal channels
    assert (out["logits"].argmax(1).numpy() == labels[held_out]).mean() >= 0.97
    assert torch.equal(out["pool"], rgb["pool"])
    assert np.linalg.matrix_rank(np.cov(out["pool"].double().numpy(), rowvar=False)) == 64


def test_digit_classifier_refuses_other_sizes():
    with pytest.raises(UserError, match="28x28"):
        load_digit_classifier()(torch.zeros(2, 1, 32, 32, dtype=torch.uint8))
    with pytest.raises(UserError, match="NCHW"):
        load_digit_classifier()(torch.zeros(2, 28, 28, 3, dtype=torch.uint8))


# ---- FD_DINOv2 --------------------------------------------------------------------------------------------

DINOV2_TEST_ARCH = "vit_small_patch14_dinov2"  # ViT-L/14's family at a CPU-test size, random weights


@pytest.fixture(scope="module")
def small_dinov2():
    from dit.eval.dinov2 import DINOv2Features, create_dinov2

    torch.manual_seed(0)
    return DINOv2Features(create_dinov2(DINOV2_TEST_ARCH), "dinov2-test-random").eval().requires_grad_(False)


def test_fd_dinov2_statistics_equal_a_direct_computation(small_dinov2):
    """Our statistics of a set equal running the timm model directly on dgm-eval's preprocessing (224 px
    bicubic resize of the uint8 image, [0, 1], ImageNet mean/std, the normalised CLS token)."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import v2 as T

    from dit.eval.evaluator import extract_features
    from dit.eval.reference import stats_from_features

    images = torch.randint(0, 256, (6, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    local, _ = extract_features(small_dinov2, [images[:4], images[4:]])
    ours = stats_from_features(local, small_dinov2.name, "test")

    transform = T.Compose([
        T.Resize((224, 224), InterpolationMode.BICUBIC, antialias=True),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])  # fmt: skip
    with torch.no_grad():
        x = torch.stack([transform(image) for image in images])
        direct = small_dinov2.model.forward_features(x)[:, 0].double().numpy()
    assert ours.mu == pytest.approx(direct.mean(axis=0), abs=1e-5)
    assert ours.sigma == pytest.approx(np.cov(direct, rowvar=False), abs=1e-5)
    assert small_dinov2.model.pos_embed.shape[1] == 1 + 16 * 16  # 224 px at patch 14: CLS and 16 x 16 patches


def test_dinov2_flops_are_counted(small_dinov2):
    """ViT FLOPs from the layer shapes: 2 x (12 T d^2 + 2 T^2 d) a block plus the patch embedding."""
    m = small_dinov2.model
    t, d = 1 + 16 * 16, m.embed_dim
    expected = 2 * (len(m.blocks) * (12 * t * d * d + 2 * t * t * d) + 256 * 3 * 14 * 14 * d)
    assert small_dinov2.flops_per_image() == pytest.approx(expected, rel=0.01)


def test_dinov2_weights_from_a_file(tmp_path):
    """Meta's layout (mask_token, a 37 x 37 position grid for 518 px) loads with the grid resampled to 16 x 16;
    a missing file is one line naming where the weights come from."""
    import timm

    from dit.eval.dinov2 import load_dinov2

    source = timm.create_model(DINOV2_TEST_ARCH, pretrained=False, num_classes=0, img_size=518)
    state = {**source.state_dict(), "mask_token": torch.zeros(1, source.embed_dim)}
    torch.save(state, tmp_path / "dinov2.pth")
    net = load_dinov2(str(tmp_path / "dinov2.pth"), arch=DINOV2_TEST_ARCH)
    assert net.name.startswith(f"dinov2-{DINOV2_TEST_ARCH}-sha256:") and net.model.pos_embed.shape[1] == 257
    assert torch.equal(net.model.blocks[3].attn.qkv.weight, source.blocks[3].attn.qkv.weight)
    assert net(torch.zeros(2, 1, 28, 28, dtype=torch.uint8))["pool"].shape == (2, source.embed_dim)
    with pytest.raises(UserError, match="vit_large_patch14_dinov2.lvd142m.*dinov2_vitl14_pretrain.pth"):
        load_dinov2(str(tmp_path / "missing.pth"))
