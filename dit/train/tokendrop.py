"""When a run drops tokens, and which: SPRINT's two stages (after ``--token-drop-until`` every block sees every
token, and the fusion fuses the full-token output, as sampling does) and the kept set keyed by (seed, step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dit.io.config import Section, option
from dit.model.config import DiTConfig
from dit.model.tokendrop import draw_kept
from dit.runtime import Stream, mix_seed


@dataclass(frozen=True)
class TokenDropSection(Section):
    """The stages of a token-drop run (``--token-drop R`` is the model's)."""

    token_drop_until: int | None = option(
        None, "with --token-drop: the step from which every block sees every token (SPRINT's second stage); "
        "default: drop until the end", ge=0,
    )  # fmt: skip

    def dropping(self, model: DiTConfig, step: int) -> bool:
        return bool(model.token_drop) and (self.token_drop_until is None or step < self.token_drop_until)

    def dropped_steps(self, model: DiTConfig, steps: int) -> int:
        if not model.token_drop:
            return 0
        return steps if self.token_drop_until is None else min(steps, self.token_drop_until)


def kept_tokens(model: DiTConfig, seed: int, step: int, batch: int, device) -> torch.Tensor:
    """(batch, K) kept token indices of step ``step``'s global batch, from its own (seed, step) stream."""
    g = torch.Generator(device=device).manual_seed(mix_seed(Stream.TOKENS, seed, step))
    return draw_kept(g, batch, model.tokens, model.kept_tokens(), device)
