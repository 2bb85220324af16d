"""Post-hoc EMA (Karras et al., EDM2, arXiv 2312.02696, section 3 and appendix C): power-function profiles saved
every N steps, and any other profile reconstructed from them by least squares."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from dit.checkpoint.format import checksum_path, list_checkpoints, load_checkpoint, stamped
from dit.io.errors import UserError

SNAPSHOTS = "ema"  # the snapshots' folder inside a run's checkpoints folder
PROFILES = "ema_profiles"  # a payload's key: {sigma_rel as text: EMA state dict}
MAX_SIGMA_REL = 12**-0.5  # gamma = 0: the plain average of every step since the start, the widest profile
MAX_RESIDUAL = 0.1  # the largest relative L2 distance of a reconstructed profile from the one asked for


def profile_key(sigma_rel: float) -> str:
    return f"{sigma_rel:g}"


def gamma_of(sigma_rel: float) -> float:
    """The exponent whose profile has width ``sigma_rel``: the largest real root of
    ``(g + 2)^2 (g + 3) = (g + 1) / sigma_rel^2``, which is >= 0 for ``0 < sigma_rel <= MAX_SIGMA_REL``."""
    if not 0 < sigma_rel <= MAX_SIGMA_REL:
        raise ValueError(f"sigma_rel must be in (0, {MAX_SIGMA_REL:.4f}], got {sigma_rel}")
    t = sigma_rel**-2.0
    roots = np.roots([1.0, 7.0, 16.0 - t, 12.0 - t])
    return max(0.0, float(max(r.real for r in roots if abs(r.imag) < 1e-9)))


def _dot(ta, ga, tb, gb):
    """The inner products of the profiles (``ta``, ``ga``) and (``tb``, ``gb``) (arrays, broadcast), in the
    form whose powers never overflow: ``(g_a+1)(g_b+1) / (g_a+g_b+1) * (lo/hi)^g_hi / hi``."""
    lo, hi = np.minimum(ta, tb), np.maximum(ta, tb)
    g_hi = np.where(ta >= tb, ga, gb)
    return (ga + 1) * (gb + 1) / (ga + gb + 1) * (lo / hi) ** g_hi / hi


def coefficients(steps, gammas, step: int, gamma: float) -> tuple[np.ndarray, float]:
    """The snapshots' weights whose sum is nearest (L2) to the profile (``step``, ``gamma``), and the residual."""
    t = np.asarray(steps, dtype=np.float64) / step  # the solution is the same on any time scale
    g = np.asarray(gammas, dtype=np.float64)
    a = _dot(t[:, None], g[:, None], t[None, :], g[None, :])
    b = _dot(t, g, 1.0, gamma)
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    own = _dot(1.0, gamma, 1.0, gamma)
    residual = max(0.0, float(own - 2 * x @ b + x @ a @ x)) / own
    return x, float(residual) ** 0.5


def snapshot_folder(checkpoints: str | os.PathLike) -> Path:
    return Path(checkpoints) / SNAPSHOTS


def list_snapshots(checkpoints: str | os.PathLike) -> list[tuple[int, Path]]:
    """The run's complete snapshots as (step, path), oldest first (files or sharded folders)."""
    return list_checkpoints(snapshot_folder(checkpoints))


def set_aside_snapshots(checkpoints: str | os.PathLike, step: int) -> list[str]:
    """Move the snapshots after ``step`` to ``ema/after-NNNNNNN/`` (off this segment's line); lines for the log."""
    newer = [p for s, p in list_snapshots(checkpoints) if s > step]
    if not newer:
        return []
    dest = snapshot_folder(checkpoints) / f"after-{step:07d}"
    k = 1
    while dest.exists():
        k += 1
        dest = dest.with_name(f"after-{step:07d}.{k}")
    dest.mkdir(parents=True)
    for path in newer:
        if checksum_path(path).is_file():
            os.replace(checksum_path(path), checksum_path(dest / path.name))
        os.replace(path, dest / path.name)
    return [f"kept aside {len(newer)} EMA snapshot(s) after step {step}, off this segment's line, in {dest}"]


def reconstruct(run: str | os.PathLike, sigma_rel: float, step: int | None = None) -> dict:
    """The checkpoint of the EMA of width ``sigma_rel`` at ``step``, from run ``run``'s snapshots up to it."""
    gamma = gamma_of(sigma_rel)
    found = list_snapshots(Path(run) / "checkpoints")
    if not found:
        raise UserError(
            f"{run} holds no EMA snapshots ({snapshot_folder(Path(run) / 'checkpoints')} is empty or missing): "
            "train it with --ema-profiles (e.g. 0.05 0.1) to save them."
        )
    step = found[-1][0] if step is None else step
    used = [(s, p) for s, p in found if s <= step]
    if step not in {s for s, _ in used}:
        raise UserError(
            f"{run} has no EMA snapshot at step {step} (its snapshots: steps {found[0][0]} to {found[-1][0]}): "
            "pass a --step among them."
        )
    snaps = [(s, load_checkpoint(p)) for s, p in used]
    terms = [(s, float(k), w) for s, ckpt in snaps for k, w in ckpt[PROFILES].items()]
    x, residual = coefficients([s for s, _, _ in terms], [gamma_of(k) for _, k, _ in terms], step, gamma)
    if residual > MAX_RESIDUAL:
        raise UserError(
            f"the snapshots of {run} reach sigma_rel {sigma_rel:g} at step {step} only to within {residual:.1%} "
            f"of its profile (at most {MAX_RESIDUAL:.0%}): pass a sigma_rel nearer the tracked ones "
            f"({', '.join(sorted({k for _, c in snaps for k in c[PROFILES]}))}), or snapshot more often."
        )
    total = {name: torch.zeros_like(v, dtype=torch.float64) for name, v in terms[0][2].items()}
    for coef, (_, _, weights) in zip(x, terms):
        for name, v in weights.items():
            total[name].add_(v.double(), alpha=float(coef))
    last = snaps[-1][1]
    made = {"sigma_rel": sigma_rel, "gamma": gamma, "step": step, "residual": residual,
            "snapshots": [[s, k] for s, k, _ in terms], "coefficients": [float(c) for c in x]}  # fmt: skip
    ema = {name: v.to(terms[0][2][name].dtype) for name, v in total.items()}
    run = {k: last[k] for k in ("model_config", "config", "latent_norm") if k in last}  # what a sampler reads
    return stamped(step, {"ema": ema, **run, "posthoc_ema": made})
