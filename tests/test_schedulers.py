"""Samplers through diffusers' schedulers, the guidance interval, and the sampling plan that dit-cost reads.

A spy on ``DiT.forward`` sees every pass a sampler makes: a guided evaluation is one pass over the doubled
batch [conditional; unconditional], an unguided one a pass over the conditional rows alone. Tiny random DiTs
(8x8x4 latents) with few steps; the diffusers DDIM scheduler is held to our DDIM.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import TINY, randomize

from dit.io.errors import UserError
from dit.model.dit import DiT
from dit.objectives.gaussian import create_diffusion
from dit.objectives.samplers import SCHEDULER_SAMPLERS, check_guidance_interval, sampling_plan
from dit.objectives.schedulers import make_scheduler, scheduler_sample
from dit.objectives.transport import Transport
from dit.sample.generate import Guidance, Sampler, SamplingModel, noise_seed, sample_latents

pytest.importorskip("diffusers")

INTERVAL = (0.25, 0.75)  # no diffusion timestep / 1000 nor flow grid point below lies on either end


def tiny_model(learn_sigma: bool = True, std: float = 0.1) -> DiT:
    return randomize(DiT(**{**TINY, "learn_sigma": learn_sigma}), 0, std=std).eval()


def diffusion_model(predict_xstart: bool = False, std: float = 0.1) -> SamplingModel:
    """An epsilon model with a learned variance (DiT's), or the quick start's: x0, cosine betas, fixed variance."""
    if predict_xstart:
        return SamplingModel(tiny_model(False, std), "random", 8, None, None, "squaredcos_cap_v2", True)
    return SamplingModel(tiny_model(True, std), "random", 8, None, None)


def flow_model() -> SamplingModel:
    return SamplingModel(tiny_model(False), "random", 8, None, None, transport=Transport())


@pytest.fixture
def passes(monkeypatch) -> list[tuple[int, float]]:
    """(rows, time of the first row) of every DiT forward pass; diffusion times as t/1000, flow times as t."""
    seen, original = [], DiT.forward

    def spy(self, x, t, y):
        time = float(t[0]) / 1000 if t.dtype == torch.long else float(t[0])
        seen.append((len(x), time))
        return original(self, x, t, y)

    monkeypatch.setattr(DiT, "forward", spy)
    return seen


CASES = [("diffusion", s, None) for s in ("ddpm", "ddim", *SCHEDULER_SAMPLERS)] + [
    ("flow", "ode", m) for m in ("euler", "heun", "ab2", "ab3", "ab4")
] + [("flow", "sde", m) for m in ("euler", "heun")]  # fmt: skip


@pytest.mark.parametrize("objective, kind, method", CASES)
def test_every_sampler_makes_its_planned_evaluations_guided_only_inside_the_interval(
    objective, kind, method, passes
):
    sm = flow_model() if objective == "flow" else diffusion_model()
    sampler = Sampler(sm, 6, kind, method=method, guidance=Guidance(2.0, interval=INTERVAL))
    images = 3
    out = sample_latents(sm, sampler, [1, 2, 3], [noise_seed(0, i) for i in range(images)])
    plan = sampler.plan
    assert out.shape == (images, 4, 8, 8) and torch.isfinite(out).all()
    assert len(passes) == plan.nfe == sampler.nfe
    guided = [rows == 2 * images for rows, _ in passes]
    assert all(rows in (images, 2 * images) for rows, _ in passes)
    assert tuple(guided) == plan.guided, "the run must guide exactly the evaluations the plan marks"
    assert [INTERVAL[0] <= t <= INTERVAL[1] for _, t in passes] == guided, "guided iff its time is inside"
    assert [t for _, t in passes] == pytest.approx(list(plan.times), abs=1e-6)  # flow: the float32 t
    assert (sampler.guided_nfe, sampler.unguided_nfe) == (plan.guided_nfe, plan.unguided_nfe)
    assert 0 < plan.guided_nfe < plan.nfe and plan.forward_passes == 2 * plan.guided_nfe + plan.unguided_nfe
    if kind == "heun":  # diffusers' Heun: 2 evaluations a step, one for the last
        assert plan.nfe == 2 * 6 - 1


def test_an_adaptive_sampler_guides_by_the_time_it_reaches(passes):
    pytest.importorskip("torchdiffeq")
    sm = flow_model()
    sampler = Sampler(sm, 1, "ode", method="dopri5", guidance=Guidance(2.0, interval=INTERVAL))
    sample_latents(sm, sampler, [1, 2], [0, 1])
    guided = [rows == 4 for rows, _ in passes]
    assert [INTERVAL[0] <= t <= INTERVAL[1] for _, t in passes] == guided and 0 < sum(guided) < len(guided)
    assert (sampler.guided_nfe, sampler.unguided_nfe) == (sum(guided), len(guided) - sum(guided))
    assert sampler.plan.nfe is None  # known after the run only


@pytest.mark.parametrize("predict_xstart", [False, True])
def test_diffusers_ddim_scheduler_equals_our_ddim(predict_xstart):
    """Our betas and respacing configure the scheduler; the learned-sigma channels never reach it."""
    sm = diffusion_model(predict_xstart)
    d = create_diffusion("10", noise_schedule=sm.noise_schedule, learn_sigma=not predict_xstart,
                         predict_xstart=predict_xstart)  # fmt: skip
    x, kwargs = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), {"y": torch.tensor([1, 2])}
    with torch.no_grad():
        ours = d.ddim_sample_loop(sm.model, x.shape, x, clip_denoised=False, model_kwargs=kwargs)
        scheduler = make_scheduler("DDIMScheduler", d, set_alpha_to_one=True, clip_sample=False)
        theirs = scheduler_sample(scheduler, d, sampling_plan("ddim", 10), sm.model, x, model_kwargs=kwargs)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5 * float(ours.abs().max()))


def test_higher_order_schedulers_beat_ddim_at_equal_steps():
    """Against a 1,000-step DDIM, 20 steps of each multistep solver (or of Heun) land closer than 20 of DDIM;
    Euler on our epsilon model is DDIM itself. The scheduler's schedule and timesteps are ours, or not."""
    sm = diffusion_model(std=0.05)
    seeds = [noise_seed(0, i) for i in range(2)]
    reference = sample_latents(sm, Sampler(sm, 1000, "ddim"), [1, 2], seeds)

    def error(kind: str) -> float:
        out = sample_latents(sm, Sampler(sm, 20, kind), [1, 2], seeds)
        return float((out - reference).norm() / reference.norm())

    ddim = error("ddim")
    assert error("euler") == pytest.approx(ddim, rel=1e-3)
    for kind in ("dpmpp-2m", "unipc", "deis", "heun"):
        assert error(kind) < 0.5 * ddim, kind


@pytest.mark.parametrize(
    "objective, kind", [("diffusion", "ddpm"), ("diffusion", "dpmpp-2m-sde"), ("flow", "sde")]
)
def test_stochastic_samplers_make_the_same_images_in_any_batch_split(objective, kind):
    sm = flow_model() if objective == "flow" else diffusion_model()
    sampler = Sampler(sm, 5, kind, guidance=Guidance(1.5))
    labels, seeds = [1, 2, 3], [noise_seed(4, i) for i in range(3)]
    together = sample_latents(sm, sampler, labels, seeds)
    split = torch.cat(
        [sample_latents(sm, sampler, labels[:2], seeds[:2]), sample_latents(sm, sampler, labels[2:], seeds[2:])]
    )
    torch.testing.assert_close(together, split, atol=1e-5, rtol=1e-5)
    other = sample_latents(sm, sampler, labels, [noise_seed(5, i) for i in range(3)])
    assert not torch.allclose(together, other), "the noise must come from the seeds"


@pytest.mark.parametrize("kind, method", [("heun", None), ("dpmpp-2m", None), ("sde", "heun"), ("ode", "ab3")])
def test_dit_cost_plans_the_passes_the_run_makes(kind, method, passes, capsys):
    from dit.cost.__main__ import main

    flags = ["sample", "--model", "DiT-S/2", "--sampler", kind, "--num-sampling-steps", "7", "--guidance-scale", "3",
             "--guidance-interval", *map(str, INTERVAL), "--json"]  # fmt: skip
    assert main(flags + (["--sampling-method", method] if method else [])) == 0
    planned = json.loads(capsys.readouterr().out)
    sm = flow_model() if kind in ("ode", "sde") else diffusion_model()
    sampler = Sampler(sm, 7, kind, method=method, guidance=Guidance(3.0, interval=INTERVAL))
    sample_latents(sm, sampler, [1], [0])
    ran = {"guided": sum(rows == 2 for rows, _ in passes), "unguided": sum(rows == 1 for rows, _ in passes)}
    assert (planned["guided_nfe"], planned["unguided_nfe"]) == (ran["guided"], ran["unguided"])
    assert planned["forward_passes_per_image"] == 2 * ran["guided"] + ran["unguided"]


def test_the_planner_needs_no_torch():
    code = (
        "import sys; import dit.cost.__main__ as m; "
        "m.main(['sample', '--model', 'DiT-XL/2', '--sampler', 'dpmpp-2m', '--guidance-interval', '0.2', '0.8']); "
        "m.main(['sample', '--model', 'DiT-XL/2', '--sampler', 'sde', '--sampling-method', 'heun']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "guided in [0.2, 0.8]" in out.stdout


@pytest.mark.parametrize("interval", [(0.5,), (0.8, 0.2), (-0.1, 0.5), (0.1, 1.5), (0.1, float("nan"))])
def test_a_bad_guidance_interval_is_one_line(interval, capsys):
    """Refused where it is born, the sampling section (the field's bounds, then its check), as one line."""
    from dit.cost.__main__ import main

    assert main(["sample", "--model", "DiT-S/2", "--guidance-interval", *map(str, interval)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --guidance-interval ") and err.count("\n") == 1, err
    with pytest.raises(UserError, match="guidance_interval takes two times LO HI"):  # a study's own interval flag
        check_guidance_interval(interval)


def test_an_adaptive_sampler_has_no_plan_to_split_at_an_interval(capsys):
    from dit.cost.__main__ import main

    flags = ["sample", "--model", "DiT-S/2", "--sampler", "ode", "--sampling-method", "dopri5", "--nfe", "80"]
    assert main(flags + ["--guidance-interval", "0.2", "0.8"]) == 2
    assert "known only after a run" in capsys.readouterr().err
    assert main(flags + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["guided_nfe"] == 80


@pytest.mark.parametrize("name", sorted(SCHEDULER_SAMPLERS))
def test_few_steps_of_the_cosine_schedule_stay_finite(name):
    """At 5 of the cosine schedule's 1000 steps the last respaced beta is 1 - 1.7e-8: in diffusers' float32
    it rounded to 1 (alpha-bar 0, sigma inf) and every image of dpmpp-2m and unipc was NaN."""
    diffusion = create_diffusion("5", noise_schedule="squaredcos_cap_v2")
    scheduler = make_scheduler(name, diffusion)
    scheduler.set_timesteps(diffusion.num_timesteps)
    assert float(scheduler.alphas_cumprod[-1]) > 0
    eps = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    x = eps * scheduler.init_noise_sigma
    for k in scheduler.timesteps:  # a model that predicts the noise exactly, for data that is zero
        x = scheduler.step(eps, k, scheduler.scale_model_input(x, k)).prev_sample
    assert torch.isfinite(x).all()
