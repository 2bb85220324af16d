"""Side features of the training step (REPA, encoding images on the fly): each is a ``StepHook``, called by the
step at fixed points, so that the step has no branch for any of them.

Per step: ``draw`` (keyed randomness of the whole global batch, after the step's own draws); per micro-batch:
``prepare`` (the images before the model), ``output`` (the model's output before the objective's loss), ``loss``
(a term added to the loss, and the value counted for the log).
"""

from __future__ import annotations

import torch


class StepHook:
    """The points of the step a side feature may take part in; each default leaves the step as it is."""

    def draw(self, g: torch.Generator, batch: int, shape: tuple, device: torch.device) -> None:
        """Draw from the step's generator ``g`` what the whole global ``batch`` of samples ``shape`` needs."""

    def prepare(self, x: torch.Tensor, stored: list, sl: slice) -> torch.Tensor:
        """The model's input from this micro-batch's images ``x`` (``stored``: the data's extra items, ``sl``:
        the micro-batch's place in the global batch)."""
        return x

    def output(self, out):
        """The model's prediction from what its forward returned."""
        return out

    def loss(self, scale: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the term added to the micro-batch's loss, its unweighted value to count), each divided by
        ``scale``; None: no term."""
        return None


class EncodeImages(StepHook):
    """Images to latents inside the step (``--data-path`` with a VAE): the posterior sample is keyed by (seed,
    step) like the noise, so a resumed run or another world size encodes the same latents."""

    def __init__(self, vae: torch.nn.Module, precision):
        self.vae, self.precision, self.eps = vae, precision, None

    def draw(self, g, batch, shape, device):
        self.eps = torch.randn((batch, *shape), generator=g, device=device)

    def prepare(self, x, stored, sl):
        from dit.data.vae import encode

        with torch.no_grad(), self.precision.frozen():  # bf16: 273 GFLOP an SD image, not in fp32
            return encode(self.vae, x, eps=self.eps[sl])
