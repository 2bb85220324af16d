"""Evaluation during training: the EMA weights sample the same images every time and are scored against one
reference, so the points of a run (and of runs with the same settings) lie on one comparable curve.

Image i of an evaluation has the label ``fid_label(seed, i)`` and the noise ``noise_seed(seed, i)`` of the
stream ``Stream.EVAL`` keyed by the run's seed: the same for every evaluation, every resume and any number
of processes. Each process samples a consecutive run of the global batches and the evaluator gathers the
features in rank order, so the scores do not depend on the world size. The training loop runs it with the
MFU clock paused; its own cost (sampling and feature FLOPs, seconds) is a record of its own.
"""

from __future__ import annotations

import time

from dit.config import to_dict
from dit.cost.analytic import sampling_flops_per_image, vae_flops
from dit.eval.evaluator import SCORES, Evaluator, my_batches
from dit.eval.features import feature_net_for
from dit.eval.reference import load_reference
from dit.models import DiT
from dit.runtime import Runtime, Stream, mix_seed
from dit.sample.generate import Guidance, Sampler, SamplingModel, check_guidance, fid_label, generate, noise_seed
from dit.sampling_plan import DEFAULT_METHODS, sampling_plan


class InLoopEval:
    def __init__(self, cfg, runtime: Runtime, model_config, vae, vae_spec: str | None):
        """``cfg`` is the run's ``TrainConfig``; ``vae`` decodes latents (None for pixel-space runs).

        Everything that can fail (the reference, the feature network's weights, too few images for the
        covariance, guidance without a null class) fails here, at start-up, not at the first evaluation."""
        self.cfg, self.runtime, self.vae, self.vae_spec = cfg, runtime, vae, vae_spec
        reference = load_reference(cfg.eval_ref)
        net = feature_net_for(reference.feature_network, cfg.eval_inception_weights, runtime.device)
        self.evaluator = Evaluator(net, reference, batch_size=cfg.eval_batch_size, runtime=runtime)
        self.evaluator.check_count(cfg.eval_num_samples)
        check_guidance(cfg.eval_guidance_scale, model_config)
        seed = mix_seed(Stream.EVAL, cfg.seed)
        n, classes = cfg.eval_num_samples, model_config.num_classes
        self.labels = [fid_label(seed, i, classes) for i in range(n)]
        self.conditional = classes > 0
        self.seeds = [noise_seed(seed, i) for i in range(n)]
        decode = vae_flops(dict(vae.config), cfg.image_size).decode if vae is not None else 0.0
        self.kind = kind = cfg.eval_sampler or ("ode" if cfg.objective == "flow" else "ddim")
        plan = sampling_plan(  # the network evaluations the sampler makes: 2 a step for Heun
            kind, cfg.eval_sampling_steps, method=DEFAULT_METHODS.get(kind), guidance_scale=cfg.eval_guidance_scale
        )
        per_image = sampling_flops_per_image(
            model_config,
            plan.nfe,
            cfg.eval_guidance_scale,
            vae_decode_flops=decode,
            unguided_nfe=plan.unguided_nfe,
        )
        self.sampling_flops_per_image = per_image.total

    def describe(self) -> str:
        c = self.cfg
        return (
            f"evaluation every {c.eval_every} steps: {c.eval_num_samples:,} EMA samples ({self.kind} "
            f"{c.eval_sampling_steps} steps, guidance {c.eval_guidance_scale:g}) against {c.eval_ref} "
            f"({self.evaluator.net.name}; {', '.join(self.evaluator.metrics)}); about "
            f"{self.cost_flops() / 1e12:.4g} TFLOP an evaluation, kept out of the training MFU"
        )

    def cost_flops(self) -> float:
        n = self.cfg.eval_num_samples
        return n * (self.sampling_flops_per_image + self.evaluator.flops_per_image)

    def run(self, ema: DiT) -> dict:
        """Score the (unsharded) EMA model: the metrics, and what the evaluation itself cost."""
        c, rt = self.cfg, self.runtime
        start = time.perf_counter()
        sm = SamplingModel.from_run(ema, "ema", c.image_size, self.vae, self.vae_spec, to_dict(c))
        sampler = Sampler(sm, c.eval_sampling_steps, self.kind, guidance=Guidance(c.eval_guidance_scale))
        mine = my_batches(c.eval_num_samples, c.eval_batch_size, rt.rank, rt.world)
        was_training = ema.training
        ema.eval()

        def batches():
            for batch in mine:
                labels = [self.labels[i] for i in batch]
                images = generate(sm, sampler, labels, [self.seeds[i] for i in batch], precision=rt.precision)
                yield (images, labels) if self.conditional else images  # no labels: no class accuracy

        result = self.evaluator.evaluate(batches())
        ema.train(was_training)
        rt.sync()
        seconds = time.perf_counter() - start
        sampling_flops = self.sampling_flops_per_image * c.eval_num_samples
        return {
            **{k: result[k] for k in SCORES},
            "num_images": result["num_images"],
            "feature_network": result["feature_network"],
            "sqrtm_eps_used": result["sqrtm_eps_used"],
            "eval_guidance_scale": c.eval_guidance_scale,
            "eval_sampler": f"{sampler.describe()} {c.eval_sampling_steps} steps, {sampler.planned_nfe} evaluations",
            "eval_sampling_pflops": sampling_flops / 1e15,
            "eval_feature_pflops": result["flops"] / 1e15,
            "eval_seconds": seconds,
            "eval_sampling_seconds": seconds - result["seconds"],
        }
