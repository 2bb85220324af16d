"""Evaluation during training: the EMA weights sample the same images every time (keyed by ``Stream.EVAL``) against
one reference, so that a run's points lie on one curve; its cost is kept out of the MFU, in a record of its own."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from dit.cost.analytic import sampling_flops_per_image, vae_flops
from dit.data.images import to_uint8
from dit.eval.evaluator import SCORES, Evaluator, judges_for, my_batches
from dit.eval.features import feature_net_for
from dit.eval.reference import load_reference
from dit.io.config import FieldError, Section, option
from dit.io.errors import UserError
from dit.model.dit import DiT
from dit.objectives import Objective
from dit.objectives.sampling_section import SamplingSection
from dit.runtime import Runtime, Stream, mix_seed
from dit.runtime.stop import EvalStopped
from dit.sample.generate import Sampler, SamplingModel, generate, noise_seed
from dit.sample.labels import DEFAULT_LABELS, LABEL_MODES, set_labels


@dataclass(frozen=True)
class EvalSection(Section):
    """When and against what the EMA weights are scored during training (train.py's ``--eval-*`` flags)."""

    every: int = option(0, "steps per evaluation of the EMA weights, and one at the end (0: off)", ge=0)
    ref: str | None = option(None, "reference statistics (python -m dit.eval ref, or an ADM reference batch)")
    num_samples: int = option(1000, "images per evaluation (FID needs more than the feature dimension)", ge=1)
    batch_size: int = option(64, "evaluation images per batch on each process", ge=1)
    inception_weights: str | None = option(None, "Inception-v3 weights file, offline (default: download)")
    judge_ref: str | None = option(None, "a second judge's statistics (FD_DINOv2's, python -m dit.eval ref)")
    dinov2_weights: str | None = option(None, "DINOv2 ViT-L/14 weights file, for a FD_DINOv2 --eval-judge-ref")
    labels: str = option(
        DEFAULT_LABELS, "class labels of the samples: balanced (N/C per class) or random (DiT's); a run recorded "
        "without this option evaluated with random ones", choices=LABEL_MODES,
    )  # fmt: skip
    sigma_rel: float | None = option(
        None, "score this --ema-profiles profile (one of the tracked ones) instead of the classic EMA", gt=0
    )

    def check(self) -> None:
        if self.every and not self.ref:
            raise FieldError("{every} needs {ref}: reference statistics (python -m dit.eval ref --help).")


@dataclass(frozen=True)
class EvalSamplingSection(SamplingSection):
    """The evaluation's sampler: the sampling flags under ``--eval-``, with cheaper defaults (50 DDIM steps)."""

    FAST = True  # ddim for diffusion, ode for flow
    GUIDANCE_DEFAULT = 1.0

    sampler: str | None = option(
        None, "sampler of the evaluation samples (default: ddim for diffusion, ode for flow)",
        choices=SamplingSection.__dataclass_fields__["sampler"].metadata["choices"],
    )  # fmt: skip
    num_sampling_steps: int = option(50, "denoising steps of the evaluation samples", ge=1,
                                     aliases=("--sampling-steps",))  # fmt: skip
    guidance_scale: float | None = option(1.0, "guidance scale of the evaluation samples (1: none)",
                                          aliases=("--cfg-scale",), ge=1)  # fmt: skip


_SAMPLING_FLAG = re.compile(
    r"--(num-sampling-steps|sampler|sampling-method|last-step|guidance-interval|time-shift)\b"
)


class InLoopEval:
    def __init__(
        self,
        section: EvalSection,
        sampling: EvalSamplingSection,
        *,
        seed: int,
        image_size: int,
        objective: Objective,
        runtime: Runtime,
        model: DiT,
        vae,
        vae_spec: str | None,
        latent_norm=None,
    ):
        """Everything that can fail (reference, weights, image count, guidance) fails here, at start-up."""
        self.section, self.sampling, self.runtime = section, sampling, runtime
        self.vae, self.vae_spec = vae, vae_spec
        self.image_size, self.objective, self.latent_norm = image_size, objective, latent_norm
        reference = load_reference(section.ref)
        net = feature_net_for(reference.feature_network, section.inception_weights, runtime.device)
        judges = judges_for(reference.feature_network, section.judge_ref, section.dinov2_weights, runtime.device)
        self.evaluator = Evaluator(net, reference, batch_size=section.batch_size, runtime=runtime, judges=judges)
        self.evaluator.check_count(section.num_samples)
        model_config = model.config
        null_class = model_config.num_classes > 0 and model_config.class_dropout_prob > 0
        try:
            self.guidance_scale = sampling.guidance(null_class)
        except FieldError as e:
            raise UserError(e.spelled(lambda name: "--eval-" + name.replace("_", "-"))) from None
        seed = mix_seed(Stream.EVAL, seed)
        n, classes = section.num_samples, model_config.num_classes
        self.labels = set_labels(section.labels, seed, n, classes)
        self.conditional = classes > 0
        self.seeds = [noise_seed(seed, i) for i in range(n)]
        decode = vae_flops(dict(vae.config), image_size).decode if vae is not None else 0.0
        try:
            self.planner = Sampler.from_options(self._sampling_model(model), sampling)
        except UserError as e:  # the sampler's checks name the sampling flags; here they are --eval- ones
            raise UserError(_SAMPLING_FLAG.sub(r"--eval-\1", str(e))) from None
        plan = self.planner.plan  # the network evaluations the sampler makes: 2 a step for Heun
        per_image = sampling_flops_per_image(
            model_config, plan.nfe or sampling.num_sampling_steps, self.guidance_scale, vae_decode_flops=decode,
            unguided_nfe=plan.unguided_nfe, path_drop=self.planner.guidance.path_drop,
        )  # fmt: skip
        self.sampling_flops_per_image = per_image.total

    def _sampling_model(self, model: DiT) -> SamplingModel:
        return SamplingModel.from_objective(
            model, "ema", self.image_size, self.vae, self.vae_spec, self.objective, self.latent_norm
        )

    def describe(self) -> str:
        c, s = self.section, self.sampling
        flops = c.num_samples * (self.sampling_flops_per_image + self.evaluator.flops_per_image)
        return (
            f"evaluation every {c.every} steps: {c.num_samples:,} EMA samples ({self.planner.describe()} "
            f"{s.num_sampling_steps} steps, guidance {self.guidance_scale:g}, {c.labels} labels) against {c.ref} "
            f"({self.evaluator.net.name}; {', '.join(self.evaluator.metrics)}"
            f"{''.join(', ' + j.key for j in self.evaluator.judges)}); about "
            f"{flops / 1e12:.4g} TFLOP an evaluation, kept out of the training MFU"
        )

    def run(self, ema: DiT, stop=None) -> dict:
        """Score the EMA model; a ``stop`` between batches drops the evaluation (``EvalStopped``)."""
        c, rt = self.section, self.runtime
        start = time.perf_counter()
        sm = self._sampling_model(ema)
        sampler = Sampler.from_options(sm, self.sampling)
        mine = my_batches(c.num_samples, c.batch_size, rt.rank, rt.world)
        was_training = ema.training
        ema.eval()
        # every rank asks the (collective) flag equally often: at each of the fewest batches any rank holds
        checks = min(len(my_batches(c.num_samples, c.batch_size, r, rt.world)) for r in range(rt.world))

        def batches():
            for i, batch in enumerate(mine):
                if stop is not None and i < checks and stop.should_stop():
                    ema.train(was_training)
                    raise EvalStopped(stop.raised)
                labels = [self.labels[i] for i in batch]
                seeds = [self.seeds[i] for i in batch]
                images = to_uint8(generate(sm, sampler, labels, seeds, precision=rt.precision))
                yield (images, labels) if self.conditional else images  # no labels: no class accuracy

        result = self.evaluator.evaluate(batches())
        ema.train(was_training)
        rt.sync()
        seconds = time.perf_counter() - start
        steps = self.sampling.num_sampling_steps
        return {
            **{k: result[k] for k in SCORES},
            "num_images": result["num_images"],
            "feature_network": result["feature_network"],
            "sqrtm_eps_used": result["sqrtm_eps_used"],
            "intervals": result["intervals"],
            "eval_labels": c.labels if self.conditional else None,
            "eval_guidance_scale": self.guidance_scale,
            "eval_guidance_interval": list(self.sampling.guidance_interval or ()) or None,
            "eval_sampler": f"{sampler.describe()} {steps} steps, {sampler.planned_nfe} evaluations",
            "eval_sampling_pflops": self.sampling_flops_per_image * c.num_samples / 1e15,
            "eval_feature_pflops": result["flops"] / 1e15,
            "eval_judge_pflops": result["flops_breakdown"]["judges"] / 1e15,  # part of eval_feature_pflops
            "eval_seconds": seconds,
            "eval_sampling_seconds": seconds - result["seconds"],
            **({"ema_sigma_rel": c.sigma_rel} if c.sigma_rel is not None else {}),
        }
