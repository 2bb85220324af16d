"""Side features of the training step (REPA, encoding on the fly) as ``StepHook``s, so that the step has no branch
for any: ``draw`` once per step, then ``prepare``, ``output`` and ``loss`` per micro-batch."""

from __future__ import annotations

import torch


class StepHook:
    """The points of the step a side feature may take part in; each default leaves the step as it is."""

    def draw(self, g: torch.Generator, batch: int, shape: tuple, device: torch.device) -> None:
        """Draw from the step's generator ``g`` what the whole global ``batch`` of samples ``shape`` needs."""

    def prepare(self, x: torch.Tensor, stored: list, sl: slice) -> torch.Tensor:
        """The model's input from micro-batch images ``x`` (``stored``: the data's extra items; ``sl``: where)."""
        return x

    def output(self, out):
        """The model's prediction from what its forward returned."""
        return out

    def loss(self, scale: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the term added to the micro-batch's loss, its unweighted value to count), both / ``scale``; or None."""
        return None


class EncodeImages(StepHook):
    """Images to latents inside the step (``--data-path`` with a VAE), the posterior draw keyed by (seed, step)."""

    def __init__(self, vae: torch.nn.Module, precision):
        self.vae, self.precision, self.eps = vae, precision, None

    def draw(self, g, batch, shape, device):
        self.eps = torch.randn((batch, *shape), generator=g, device=device)

    def prepare(self, x, stored, sl):
        from dit.data.vae import encode

        with torch.no_grad(), self.precision.frozen():  # bf16: 273 GFLOP an SD image, not in fp32
            return encode(self.vae, x, eps=self.eps[sl])
