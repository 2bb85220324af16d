"""torch-fidelity's TF-compatible Inception-v3, the ADM evaluator's network: FID, sFID and IS
(docs/evaluation.md says why this library)."""

from __future__ import annotations

import os

import torch
from torch import nn

from dit.data.store import sha256_file
from dit.eval.feature_net import FeatureNet, check_nchw, read_state_dict
from dit.io.errors import UserError, require

_INCEPTION_PURPOSE = "the Inception features of FID and IS (python -m dit.eval, --eval-every)"

INCEPTION_NAME = "inception-v3-tf-2015-12-05"  # the network behind ADM's reference statistics
# torch hub's integrity convention: the file name ends in the first 8 hex digits of the file's sha256
# (torch-fidelity's weights-inception-2015-12-05-6726825d.pth and pytorch-fid's pt_inception-...-6726825d.pth).
INCEPTION_SHA256_PREFIX = "6726825d"
SFID_CHANNELS = 7  # sFID: the first 7 channels of Mixed_6d.branch1x1 (TF mixed_6/conv) in NHWC order, 17·17·7


def _torch_fidelity_inception(state_dict: dict | None) -> nn.Module:
    """torch-fidelity's TF-compatible Inception-v3 with our weights (``None``: random). Its constructor's own
    fetch (which unpickles with ``weights_only=False``) is stubbed out: we load the state dict we read safely."""
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
        # NHWC order, then the first 7 channels (TF's layout): not the first 7 of NCHW.
        self._spatial = output.permute(0, 2, 3, 1)[..., :SFID_CHANNELS].flatten(1)

    def features(self, images_uint8: torch.Tensor) -> dict[str, torch.Tensor]:
        check_nchw(images_uint8, None, "Inception-v3")
        if images_uint8.shape[1] == 1:
            images_uint8 = images_uint8.expand(-1, 3, -1, -1)
        pool, logits = self.net(images_uint8)
        spatial, self._spatial = self._spatial, None
        return {"pool": pool, "logits": logits, "spatial": spatial}


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
    """Inception-v3 with the TF 2015-12-05 weights (downloaded if ``weights`` is None) or the given file, named
    ADM's only if its sha256 has the published prefix (else by its hash: its statistics never meet ADM's)."""
    if weights is not None and not os.path.isfile(weights):
        raise UserError(f"--inception-weights {weights}: no such file.")
    path = weights if weights is not None else _download_inception()
    sha = sha256_file(path)
    name = INCEPTION_NAME if sha.startswith(INCEPTION_SHA256_PREFIX) else f"inception-v3-compat-sha256:{sha[:16]}"
    net = InceptionFeatures(read_state_dict(path, "--inception-weights"), name)
    return net.to(device).eval().requires_grad_(False)
