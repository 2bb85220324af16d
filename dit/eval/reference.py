"""Reference statistics: ADM's reference batches (TF Inception-v3's; ``arr_0`` is P/R's reference set) and our
``.npz`` files with ADM's array names, no pickle, and a ``meta`` JSON with a checksum."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from dataclasses import dataclass, field

import numpy as np
import torch

from dit import __version__
from dit.eval.inception import INCEPTION_NAME
from dit.eval.metrics import mean_cov
from dit.eval.sources import NpzImages
from dit.io.atomic import atomic_write
from dit.io.errors import WRITER_KEY, UserError, refuse_newer_format

FORMAT = "dit-ledger-eval-stats/1"
_ARRAYS = ("mu", "sigma", "mu_s", "sigma_s", "features")


@dataclass
class ReferenceStats:
    feature_network: str
    mu: np.ndarray
    sigma: np.ndarray
    num_images: int | None  # None: ADM's statistics cover a whole data set of unstated size
    features: np.ndarray | None = None  # pool features of the reference images (precision/recall)
    mu_s: np.ndarray | None = None  # sFID statistics
    sigma_s: np.ndarray | None = None
    source: str = ""
    images: NpzImages | None = field(default=None, repr=False)  # ADM's arr_0, embedded when P/R needs it

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in _ARRAYS if getattr(self, k) is not None}


def stats_from_features(
    features: dict[str, torch.Tensor], feature_network: str, source: str, keep_features: bool = True
) -> ReferenceStats:
    """Statistics of a set's features (``pool``, and ``spatial`` where the network has it)."""
    pool = features["pool"].double().cpu().numpy()
    mu, sigma = mean_cov(pool)
    stats = ReferenceStats(feature_network, mu, sigma, len(pool), source=source)
    if keep_features:
        stats.features = pool.astype(np.float32)
    if features.get("spatial") is not None:
        stats.mu_s, stats.sigma_s = mean_cov(features["spatial"].double().cpu().numpy())
    return stats


def checksum(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over every array's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def save_stats(path: str, stats: ReferenceStats) -> None:
    """Write ``stats`` atomically as an uncompressed .npz (with the meta record and the checksum)."""
    arrays = stats.arrays()
    meta = {
        "format": FORMAT,
        WRITER_KEY: __version__,
        "feature_network": stats.feature_network,
        "num_images": stats.num_images,
        "source": stats.source,
        "sha256": checksum(arrays),
    }
    atomic_write(path, lambda f: np.savez(f, meta=np.array(json.dumps(meta)), **arrays))


_READ_ERRORS = (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError)  # what a damaged .npz raises
_META_KEYS = {"format": str, "feature_network": str, "num_images": (int, type(None)), "source": str, "sha256": str}


def load_reference(path: str) -> ReferenceStats:
    """Our statistics (checksum verified) or an ADM batch, checked completely on opening."""
    if not os.path.isfile(path):
        raise UserError(f"reference {path}: no such file.")
    damaged = (
        f"reference {path} is damaged or not an .npz file ({{e}}): copy it again, or write it again with "
        "python -m dit.eval ref."
    )
    try:
        with np.load(path, allow_pickle=False) as f:
            keys = set(f.files)
            if "meta" in keys:
                stats = _ours(path, f)
            elif {"mu", "sigma"} <= keys:
                spatial = {k: f[k] for k in ("mu_s", "sigma_s") if k in keys}
                stats = ReferenceStats(
                    INCEPTION_NAME, f["mu"], f["sigma"], None, **spatial, source=f"ADM reference batch {path}"
                )
            else:
                raise UserError(
                    f"{path} holds neither statistics (mu, sigma) nor our meta record (it has {sorted(keys)}). For "
                    f"a set of images, write statistics first: python -m dit.eval ref --npz {path} --feature-net "
                    "NET --out REF.npz."
                )
    except UserError:
        raise
    except _READ_ERRORS as e:
        raise UserError(damaged.format(e=str(e).rstrip(".") or type(e).__name__)) from None
    _check_arrays(path, stats)
    if stats.num_images is None and "arr_0" in keys:  # ADM's batch: its images are the P/R reference set
        stats.images = NpzImages(path)
        stats.images.verify()
    return stats


def _ours(path: str, f) -> ReferenceStats:
    try:
        meta = json.loads(str(f["meta"]))
    except json.JSONDecodeError as e:
        raise UserError(
            f"{path}: its meta record is not JSON ({e}): write the file again with python -m dit.eval ref."
        ) from None
    if isinstance(meta, dict):  # before the keys: a newer format may name them otherwise
        refuse_newer_format(path, "reference statistics file", meta.get("format"), FORMAT, meta.get(WRITER_KEY))
    wrong = [
        k for k, kind in _META_KEYS.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), kind)
    ]
    if wrong:
        raise UserError(
            f"{path}: its meta record lacks or mistypes {', '.join(wrong)}: write the file again with python -m "
            "dit.eval ref."
        )
    if meta["format"] != FORMAT:
        raise UserError(f"{path} is statistics format {meta['format']!r}; this version reads {FORMAT!r}.")
    arrays = {k: f[k] for k in _ARRAYS if k in f.files}
    if checksum(arrays) != meta["sha256"]:
        raise UserError(
            f"{path} fails its checksum: the file was changed or damaged after it was written. Write it again "
            "with python -m dit.eval ref."
        )
    if "mu" not in arrays or "sigma" not in arrays:
        raise UserError(
            f"{path} has no {'mu' if 'mu' not in arrays else 'sigma'}: write it again with python -m dit.eval ref."
        )
    return ReferenceStats(meta["feature_network"], num_images=meta["num_images"], source=meta["source"], **arrays)


def _check_arrays(path: str, stats: ReferenceStats) -> None:
    """Shapes that fit together, and finite values."""
    problems = []
    for mu_key, sigma_key in (("mu", "sigma"), ("mu_s", "sigma_s")):
        mu, sigma = getattr(stats, mu_key), getattr(stats, sigma_key)
        if (mu is None) != (sigma is None):
            problems.append(
                f"{mu_key if mu is not None else sigma_key} without {sigma_key if mu is not None else mu_key}"
            )
            continue
        if mu is None:
            continue
        if mu.ndim != 1 or sigma.shape != (len(mu), len(mu)):
            problems.append(f"{mu_key} {mu.shape} and {sigma_key} {sigma.shape} do not fit (d and d x d)")
    if stats.features is not None and (stats.features.ndim != 2 or stats.features.shape[1] != len(stats.mu)):
        problems.append(f"features {stats.features.shape} are not N x {len(stats.mu)}")
    if stats.num_images is not None and stats.num_images < 2:
        problems.append(f"num_images {stats.num_images}")
    for name, array in stats.arrays().items():
        if not np.issubdtype(array.dtype, np.floating):
            problems.append(f"{name} is {array.dtype}, not floating point")
        elif not np.isfinite(array).all():
            problems.append(f"{name} holds {np.count_nonzero(~np.isfinite(array)):,} non-finite values")
    if problems:
        raise UserError(
            f"reference {path} is unusable: {'; '.join(problems)}. Write it again with python -m dit.eval ref."
        )


def digits_reference(net, batch_size: int = 500) -> ReferenceStats:
    """Statistics of MNIST-5k's 4,000 training digits (``digit_split``) under the digit network: the quick start's reference."""
    from dit.data.digits import digit_split, load_mnist_5k

    images, labels = load_mnist_5k()
    train, _ = digit_split(labels)
    x = torch.from_numpy(images[train]).unsqueeze(1)
    with torch.no_grad():
        pool = torch.cat([net(x[i : i + batch_size])["pool"] for i in range(0, len(x), batch_size)])
    return stats_from_features({"pool": pool}, net.name, "MNIST-5k training digits (4,000, 400 per class)")
