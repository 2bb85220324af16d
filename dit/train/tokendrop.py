"""When a run drops tokens, and which: SPRINT's two stages, the kept set keyed by (seed, step).

The model's drop ratio and layout are model fields (``DiTConfig.token_drop``: they decide whether it has a
mask token and a fusion); this section says until which step training drops tokens. From that step on every
block sees every token (SPRINT's full-token fine-tune); the model keeps its fusion, which then fuses the
dense features with the full-token middle's output, as sampling does.
"""

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
        """Whether step ``step`` drops tokens."""
        return bool(model.token_drop) and (self.token_drop_until is None or step < self.token_drop_until)

    def dropped_steps(self, model: DiTConfig, steps: int) -> int:
        """How many of the first ``steps`` steps dropped tokens."""
        if not model.token_drop:
            return 0
        return steps if self.token_drop_until is None else min(steps, self.token_drop_until)


def kept_tokens(model: DiTConfig, seed: int, step: int, batch: int, device) -> torch.Tensor:
    """(batch, K) kept token indices of step ``step``'s global batch, from its own (seed, step) stream: the same
    on every rank, on a resume and on any world size (a rank takes its samples' rows)."""
    g = torch.Generator(device=device).manual_seed(mix_seed(Stream.TOKENS, seed, step))
    return draw_kept(g, batch, model.tokens, model.kept_tokens(), device)
