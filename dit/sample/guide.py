"""Autoguidance's guide (Karras et al. 2024, arXiv 2406.02507): a smaller or less-trained model of the same task,
run conditionally in place of the unconditional pass, loaded and checked beside the model it guides."""

from __future__ import annotations

import os
from dataclasses import dataclass

from dit.io.config import Section, option
from dit.io.errors import UserError
from dit.model.dit import DiT
from dit.sample.generate import SamplingModel
from dit.sample.loading import read_model, recorded_objective


@dataclass(frozen=True)
class GuideSection(Section):
    """The guide (``--guide-*``): guidance extrapolates from its conditional output, not the unconditional pass."""

    ckpt: str | None = option(
        None, "autoguidance: guide with this checkpoint, a smaller or earlier model of the same classes, image "
        "size, latents and objective, instead of the unconditional pass (--guidance-scale and --guidance-interval "
        "apply as to classifier-free guidance)",
    )  # fmt: skip
    ema: bool = option(True, "the guide's EMA weights (--no-guide-ema: its raw weights)")


GUIDE_PREFIX = "guide_"
GUIDE_INPUTS = {GUIDE_PREFIX + "ckpt": "file"}  # what GuideSection's faces read


def load_guide(g: GuideSection, sm: SamplingModel, device) -> DiT | None:
    """The guide for the model ``sm`` on ``device`` (None without ``--guide-ckpt``); another task is refused."""
    if g.ckpt is None:
        return None
    if not os.path.isfile(g.ckpt):  # the checkpoint reader's own message names --ckpt
        raise UserError(f"guide checkpoint {g.ckpt} is not a file: pass the path of a .pt file (--guide-ckpt).")
    net, which, run, latent_norm = read_model(g.ckpt, use_ema=g.ema, device=device)
    image_size = run.get("image_size") or net.config.input_size * (sm.image_size // sm.config.input_size)
    guide = SamplingModel.from_objective(
        net, which, image_size, None, None, recorded_objective(run, net.config), latent_norm
    )
    differences = task_differences(sm, guide)
    if differences:
        raise UserError(
            f"the guide {g.ckpt} is a model of another task ({'; '.join(differences)}): pass a guide of this "
            "model's task, such as a smaller model or an earlier checkpoint of its run."
        )
    return net


def task_differences(sm: SamplingModel, guide: SamplingModel) -> list[str]:
    """How ``guide``'s outputs differ in meaning from ``sm``'s (``Objective.task``); empty if it can guide."""
    m, gc = sm.config, guide.config
    out = []
    if gc.num_classes != m.num_classes:
        out.append(f"{gc.num_classes} classes, the model {m.num_classes}")
    if guide.image_size != sm.image_size:
        out.append(f"{guide.image_size} px images, the model {sm.image_size} px")
    if (gc.in_channels, gc.input_size) != (m.in_channels, m.input_size):
        out.append(f"inputs of {gc.in_channels} x {gc.input_size}^2, the model {m.in_channels} x {m.input_size}^2")
    norms = [n and n.record() for n in (guide.latent_norm, sm.latent_norm)]
    if norms[0] != norms[1]:
        kinds = ["per-channel statistics" if n else "the VAE's scale" for n in norms]
        out.append(f"latents normalised by {kinds[0]}, the model's by {kinds[1]}" if kinds[0] != kinds[1]
                   else "latents normalised by other per-channel statistics than the model's")  # fmt: skip
    mine, theirs = sm.objective.task(), guide.objective.task()
    keys = ["objective"] if mine["objective"] != theirs["objective"] else list(mine)
    out += [f"{k} {theirs[k]}, the model {mine[k]}" for k in keys if theirs[k] != mine[k]]
    return out
