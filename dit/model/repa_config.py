"""REPA's options (Yu et al. 2024, docs/repa.md) under the ``repa_`` prefix: the frozen encoder, named alike by
every face, and the alignment it trains. No torch: ``dit-cost`` imports it."""

from __future__ import annotations

from dataclasses import dataclass

from dit.io.config import FieldError, Section, option


@dataclass(frozen=True)
class RepaEncoderSection(Section):
    """The frozen encoder whose patch features a block's tokens align with; unset: no REPA."""

    encoder: str | None = option(
        None, "REPA: a timm ViT name (vit_base_patch14_dinov2.lvd142m is REPA's) or digits-mae (ours); unset: off"
    )
    encoder_weights: str | None = option(None, "REPA: the encoder's weights file, offline (default: timm's)")
    input_size: int | None = option(
        None,
        "REPA: the encoder's input pixels (default: the DiT's token grid x the encoder's patch, e.g. 224)",
        ge=1,
    )

    def check(self) -> None:
        if self.encoder_weights and not self.encoder:
            raise FieldError("{encoder_weights} needs {encoder} NAME (the timm model they belong to).")


@dataclass(frozen=True)
class RepaSection(Section):
    """What REPA trains: a projector on block ``depth``'s tokens, its loss weighted by ``coeff``."""

    depth: int = option(8, "REPA: align the tokens after this block (1-based; REPA's 8 for XL/2)", ge=1)
    coeff: float = option(0.5, "REPA: weight of the alignment loss (minus the cosine similarity)", ge=0)
    projector_dim: int = option(2048, "REPA: hidden width of the 3-layer MLP projector", ge=1)
