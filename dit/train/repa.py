"""REPA in a training run (``--repa-encoder``): the checks, the projector, the alignment targets (the frozen
encoder inside the step, or a store's features of both flips) and their cost, as a ``StepHook``."""

from __future__ import annotations

import torch

from dit.cost.analytic import RepaFlops, repa_flops
from dit.io.errors import UserError
from dit.model.config import DiTConfig
from dit.model.projector import RepaProjector, repa_loss, resample_tokens
from dit.model.repa_config import RepaEncoderSection, RepaSection
from dit.train.hooks import StepHook


class Repa(StepHook):
    def __init__(
        self,
        encoder: RepaEncoderSection,
        repa: RepaSection,
        model_cfg: DiTConfig,
        store_manifest: dict | None,
        device: torch.device,
        precision,
    ):
        from dit.data.encoder import Encoder, encoder_shape, resolve_input_size, upstream_flops

        if not 1 <= repa.depth <= model_cfg.depth:
            raise UserError(
                f"--repa-depth {repa.depth} is outside the model's blocks 1..{model_cfg.depth}: pass a block "
                "in that range (REPA aligns block 8 of 28 for XL/2, about a third of the depth)."
            )
        self.name, self.depth, self.coeff = encoder.encoder, repa.depth, repa.coeff
        self.device, self.precision = device, precision
        self.target = self.projected = None  # this micro-batch's, from ``prepare`` and ``output`` to ``loss``
        self.grid = round(model_cfg.tokens**0.5)
        self.input_size = resolve_input_size(self.name, encoder.input_size, self.grid)
        self.stored = (store_manifest or {}).get("features")
        if store_manifest is not None:
            if self.stored is None:
                raise UserError(
                    f"--repa-encoder {self.name}: the latent store holds no encoder features. Re-extract it with "
                    f"extract_features.py --repa-encoder {self.name}, or train from --data-path images."
                )
            made = (self.stored["encoder"], self.stored["input_size"])
            if made != (self.name, self.input_size):
                raise UserError(
                    f"the latent store's features were made by {made[0]} at {made[1]} px, this run aligns with "
                    f"{self.name} at {self.input_size} px: pass --repa-encoder {made[0]} --repa-input-size "
                    f"{made[1]}, or re-extract the store."
                )
            self.encoder, self.shape = None, encoder_shape(self.name, self.input_size)
            self.upstream = upstream_flops(self.name)
        else:
            self.encoder = Encoder(self.name, encoder.encoder_weights, self.input_size, device)
            self.shape, self.upstream = self.encoder.shape, self.encoder.upstream_flops
        self.flops: RepaFlops = repa_flops(self.shape, model_cfg, repa.projector_dim)
        self.projector_dim = repa.projector_dim
        # stored features: the encoder ran once per stored view of every image, at extraction
        self.views = 2 if (store_manifest or {}).get("flips_stored") else 1
        self.extraction_flops = (
            self.flops.encoder_forward * self.views * store_manifest["num_images"] if self.cached else None
        )

    @property
    def cached(self) -> bool:
        return self.encoder is None

    def projector(self, model_cfg: DiTConfig) -> RepaProjector:
        return RepaProjector(model_cfg.hidden_size, self.projector_dim, self.shape.width)

    def targets(self, images: torch.Tensor, stored: torch.Tensor | None) -> torch.Tensor:
        """The encoder's patch tokens on the DiT's grid: the store's (``stored``), or computed from ``images``."""
        features = stored if stored is not None else self.encoder.features(images)
        return resample_tokens(features.float(), self.grid)

    # ---- in the step: + coeff x (minus the cosine similarity of projected tokens and targets, mean over tokens)

    def prepare(self, x, stored, sl):
        """The targets, from the image the DiT's input comes from (before any VAE), or from the store."""
        with self.precision.frozen():
            self.target = self.targets(x, stored[0].to(self.device, non_blocking=True) if stored else None)
        return x

    def output(self, out):
        out, self.projected = out  # RepaModel's: (the DiT's output, block ``depth``'s projected tokens)
        return out

    def loss(self, scale):
        align = repa_loss(self.projected, self.target).mean() / scale
        self.projected = self.target = None  # the graph holds them until backward; nothing else should
        return self.coeff * align, align

    def upstream_record(self) -> dict:
        """What an eval record adds to its x axis: the encoder's training (if known), the extraction."""
        record = {"upstream_pflops": self.upstream / 1e15} if self.upstream is not None else {}
        if self.extraction_flops is not None:
            record["feature_extraction_pflops"] = self.extraction_flops / 1e15
        return record

    def describe(self, dit_train_flops: float, store_manifest: dict | None) -> list[str]:
        """The start-up lines: what each part costs per training image, and where the encoder was paid."""
        f, s = self.flops, self.shape
        enc = f"{self.name} at {self.input_size} px ({s.grid}x{s.grid} patches, {s.width} wide)"
        if self.cached:
            where = (
                f"paid once, at extraction: {f.encoder_forward / 1e9:.4g} GFLOP per image x {self.views} view(s) x "
                f"{store_manifest['num_images']:,} images = {self.extraction_flops / 1e15:.4g} PFLOP; not in this "
                "run's steps (evaluation records: feature_extraction_pflops)"
            )
        else:
            where = f"forward only, {f.encoder_forward / 1e9:.4g} GFLOP per image inside every step"
        aux = f.per_step_image(self.cached)
        lines = [
            f"REPA encoder {enc}: {where}",
            f"REPA projector (3-layer MLP, {self.projector_dim} wide) on block {self.depth}'s tokens: "
            f"{f.projector_train / 1e9:.4g} GFLOP per image (3x forward {f.projector_forward / 1e9:.4g}); "
            f"auxiliary per training image {aux / 1e9:.4g} GFLOP ({aux / dit_train_flops:.1%} of the DiT's): records "
            "give mfu (the DiT alone), mfu_with_aux and aux_tflops_per_image",
        ]
        if self.upstream is not None:
            lines.append(
                f"REPA encoder {self.name} was itself trained with {self.upstream / 1e12:.4g} TFLOP (its JSON report): "
                "an upstream cost, recorded in every evaluation as upstream_pflops"
            )
        return lines
