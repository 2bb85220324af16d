"""The frontier's recipes that live in the objectives and the optimizer (issue 38): SD3's timestep shift (RAE's
``auto``), LightningDiT's velocity-direction loss, AdamW's betas and eps."""

from __future__ import annotations

import math

import pytest
import torch
from test_schedulers import diffusion_model, flow_model, passes  # noqa: F401  (passes: a fixture)

from dit.io.errors import UserError
from dit.model.config import DiTConfig
from dit.objectives.gaussian import create_diffusion
from dit.objectives.respacing import diffusion_timesteps, flow_grid
from dit.objectives.samplers import sampling_plan
from dit.objectives.section import ObjectiveSection
from dit.objectives.terms import velocity_direction
from dit.objectives.times import latent_dim, shift_factor, shift_time, unshift_time
from dit.sample.config import SampleConfig
from dit.sample.generate import Sampler, sample_latents
from dit.train.config import TrainConfig
from dit.train.optim import OptimSection

S = torch.linspace(0, 1, 101, dtype=torch.float64)


# ---- the shift ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a", [0.25, 1 / 0.3, 3.0, math.sqrt(48)])
def test_the_shift_is_sd3s_on_the_noise_axis_and_its_inverse_undoes_it(a):
    tau = 1 - S  # SD3's time: 1 = noise
    sd3 = a * tau / (1 + (a - 1) * tau)
    assert torch.allclose(1 - shift_time(S, a), sd3, atol=1e-15)
    assert torch.allclose(unshift_time(shift_time(S, a), a), S, atol=1e-14)
    assert torch.allclose(shift_time(unshift_time(S, a), a), S, atol=1e-14)
    if a > 1:  # toward the noise: every inner time has less signal
        assert (shift_time(S[1:-1], a) < S[1:-1]).all()


def test_lightningdits_shift_is_the_inverse_factor_on_our_axis():
    """LightningDiT writes SD3's formula on SiT's axis (1 = data): its 0.3 is our (SD3's) 1 / 0.3 = 3.33."""
    b = 0.3
    lightning = b * S / (1 + (b - 1) * S)
    assert torch.allclose(shift_time(S, 1 / b), lightning, atol=1e-15)


def test_auto_is_raes_square_root_of_the_latent_over_4096():
    assert shift_factor("auto", latent_dim(DiTConfig(in_channels=768, input_size=16))) == math.sqrt(48)  # RAE's
    assert shift_factor("auto", latent_dim(DiTConfig(in_channels=4, input_size=32))) == 1.0  # SD-VAE at 256
    assert shift_factor("auto", latent_dim(DiTConfig(in_channels=32, input_size=16))) == math.sqrt(2)  # VA-VAE
    assert shift_factor(2.5, 123) == 2.5


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "fast"])
def test_a_bad_shift_is_one_line_naming_the_flag(value):
    for of in (TrainConfig.of, SampleConfig.of):
        with pytest.raises(UserError, match=r"^--time-shift must be a finite number > 0 or auto, got") as e:
            of(time_shift=value)
        assert "\n" not in str(e.value)


def test_a_shift_from_a_preset_is_read_as_a_number():
    assert TrainConfig.of(time_shift="3").objective.time_shift == 3.0
    assert TrainConfig.of(time_shift="auto").objective.time_shift == "auto"


@pytest.mark.parametrize("objective", ["diffusion", "flow"])
def test_no_shift_is_todays_draw(objective):
    obj = ObjectiveSection(objective=objective, time_shift=1.0).build(
        DiTConfig(learn_sigma=objective == "diffusion")
    )
    t = obj.sample_t(64, torch.Generator().manual_seed(3), "cpu")
    g = torch.Generator().manual_seed(3)
    today = torch.randint(0, 1000, (64,), generator=g) if objective == "diffusion" else torch.rand(64, generator=g)
    assert torch.equal(t, today)


def test_the_training_draw_is_shifted_before_it_becomes_a_time_or_a_step():
    a = 3.0
    flow = ObjectiveSection(objective="flow", time_shift=a).build(DiTConfig(learn_sigma=False))
    diffusion = ObjectiveSection(time_shift=a).build(DiTConfig())
    u = torch.rand(4096, generator=torch.Generator().manual_seed(0))
    assert torch.equal(flow.sample_t(4096, torch.Generator().manual_seed(0), "cpu"), shift_time(u, a))
    steps = diffusion.sample_t(4096, torch.Generator().manual_seed(0), "cpu")
    assert torch.equal(steps, ((1 - shift_time(u, a)) * 1000).long().clamp(0, 999))
    assert steps.float().mean() > 600  # toward the noise end (999): a uniform draw's mean is 499.5


def test_auto_reaches_the_objective_from_the_model_config():
    cfg = DiTConfig(in_channels=768, input_size=16, learn_sigma=False)
    assert ObjectiveSection(objective="flow", time_shift="auto").build(cfg).time_shift == math.sqrt(48)


def test_the_flow_grid_is_shifted_inside_its_ends():
    plain, shifted = flow_grid("ode", 8, 0.0, 1.0), flow_grid("ode", 8, 0.0, 1.0, time_shift=3.0)
    assert (
        shifted == [shift_time(t, 3.0) for t in plain] and flow_grid("ode", 8, 0.0, 1.0, time_shift=1.0) == plain
    )
    sde = flow_grid("sde", 10, 0.0, 1.0, time_shift=3.0)
    assert sde[0] == 0.0 and sde[-1] == 1 - 0.04  # SiT's last step stays
    plan = sampling_plan("ode", 8, method="euler", time_shift=3.0)
    assert list(plan.times) == shifted[:-1]


def test_the_respaced_timesteps_are_shifted_ends_kept_and_collisions_refused():
    plain, shifted = diffusion_timesteps(50), diffusion_timesteps(50, time_shift=3.0)
    assert shifted[0] == 999 and shifted[-1] == 0 and len(set(shifted)) == 50
    assert shifted == sorted(shifted, reverse=True) and sum(shifted) > sum(plain)  # nearer the noise
    assert diffusion_timesteps(50, time_shift=1.0) == plain
    respaced = create_diffusion("50", time_shift=3.0)
    assert sorted(respaced.timestep_map.tolist(), reverse=True) == shifted
    with pytest.raises(UserError, match="--time-shift 3 puts two of the 500 respaced steps on one"):
        diffusion_timesteps(500, time_shift=3.0)


@pytest.mark.parametrize("kind", ["ddim", "dpmpp-2m", "ode"])
def test_a_shifted_sampler_evaluates_at_its_planned_times(kind, passes):  # noqa: F811
    sm = flow_model() if kind == "ode" else diffusion_model()
    sampler = Sampler(sm, 6, kind, method="euler" if kind == "ode" else None, time_shift=2.0)
    assert sampler.time_shift == 2.0
    sample_latents(sm, sampler, [1], [0])  # the schedulers refuse to run at other timesteps than planned
    assert [t for _, t in passes] == pytest.approx(list(sampler.plan.times))
    assert Sampler(sm, 6, kind, method="euler" if kind == "ode" else None).plan != sampler.plan


def test_the_sampler_takes_the_runs_shift_unless_told():
    sm = flow_model()
    run_shifted = type(sm)(sm.model, "random", 8, None, None, transport=sm.transport.__class__(time_shift=3.0))
    assert Sampler(run_shifted, 6, "ode").time_shift == 3.0
    assert Sampler(run_shifted, 6, "ode", time_shift=1.0).time_shift == 1.0


# ---- the velocity-direction loss ---------------------------------------------------------------------------


def test_the_velocity_direction_term_is_one_minus_the_cosine_per_position():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 4, 2, 5, generator=g), torch.randn(3, 4, 2, 5, generator=g)
    by_hand = torch.zeros(3)
    for n in range(3):
        for h in range(2):
            for w in range(5):
                p, q = pred[n, :, h, w], target[n, :, h, w]
                by_hand[n] += 1 - (p @ q) / (p.norm() * q.norm())
    assert torch.allclose(velocity_direction(pred, target), by_hand / 10, atol=1e-6)
    assert torch.allclose(velocity_direction(2 * target, target), torch.zeros(3), atol=1e-6)


def _losses(objective, weight, model_fn, **opts):
    learn = objective == "diffusion" and not opts.get("predict_xstart")
    obj = ObjectiveSection(objective=objective, cos_loss_weight=weight, **opts).build(DiTConfig(learn_sigma=learn))
    g = torch.Generator().manual_seed(1)
    x, noise = torch.randn(4, 4, 2, 2, generator=g), torch.randn(4, 4, 2, 2, generator=g)
    t = obj.sample_t(4, g, "cpu")
    return obj.training_losses(model_fn, x, t, {}, noise=noise), (obj, x, t, noise)


def _model(out_channels):
    weight = torch.nn.Parameter(torch.full((out_channels, 4), 0.3))
    return weight, lambda x, t, **_: torch.einsum("oc,nchw->nohw", weight, x) + 0.1


@pytest.mark.parametrize("objective", ["diffusion", "flow"])
def test_no_cosine_weight_is_todays_loss(objective):
    _, fn = _model(8 if objective == "diffusion" else 4)
    today, _ = _losses(objective, 0.0, fn)
    assert "cos" not in today
    terms, _ = _losses(objective, 0.5, fn)
    assert torch.equal(terms["loss"], today["loss"] + 0.5 * terms["cos"])


def test_the_flow_term_compares_the_predicted_velocity_with_the_path_velocity():
    _, fn = _model(4)
    terms, (obj, x1, t, x0) = _losses("flow", 1.0, fn)
    xt, ut = obj.transport.path.interpolate(t, x0, x1)
    assert torch.allclose(terms["cos"], velocity_direction(fn(xt, t), ut))


def test_the_diffusion_term_compares_the_implied_velocity_with_the_true_one():
    """v = sqrt(abar) eps - sqrt(1 - abar) x0; from an epsilon prediction, v_hat - v = (eps_hat - eps) / sqrt(abar)."""
    _, fn = _model(8)
    terms, (obj, x0, t, eps) = _losses("diffusion", 1.0, fn)
    d = obj.diffusion
    abar = torch.as_tensor(d.alphas_cumprod, dtype=torch.float32)[t].view(-1, 1, 1, 1)
    xt = abar.sqrt() * x0 + (1 - abar).sqrt() * eps
    eps_hat = fn(xt, t)[:, :4]
    v = abar.sqrt() * eps - (1 - abar).sqrt() * x0
    assert torch.allclose(terms["cos"], velocity_direction(v + (eps_hat - eps) / abar.sqrt(), v), atol=1e-5)


@pytest.mark.parametrize(
    "objective, opts",
    [("flow", {}), ("flow", {"prediction": "noise"}), ("diffusion", {}), ("diffusion", {"predict_xstart": True})],
)
def test_the_gradient_flows_through_the_term(objective, opts):
    out = 8 if objective == "diffusion" and not opts.get("predict_xstart") else 4
    weight, fn = _model(out)
    terms, _ = _losses(objective, 1.0, fn, **opts)
    terms["cos"].sum().backward()
    assert torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0


def test_an_implied_velocity_that_is_infinite_is_refused():
    with pytest.raises(UserError, match="cos_loss_weight needs the velocity a noise model implies"):
        ObjectiveSection(objective="flow", prediction="noise", train_eps=0.0, cos_loss_weight=1.0)
    ObjectiveSection(objective="flow", prediction="noise", cos_loss_weight=1.0)  # SiT's 1e-3 off the end


# ---- AdamW's settings and the resume ------------------------------------------------------------------------


def test_adamw_takes_the_betas_and_eps_and_a_resume_puts_this_runs_back():
    model = torch.nn.Linear(3, 2)
    default = OptimSection(fused_optimizer=False).optimizer(model).param_groups[0]
    assert (default["betas"], default["eps"]) == ((0.9, 0.999), 1e-8)  # torch's
    section = OptimSection(fused_optimizer=False, adam_beta2=0.95, adam_eps=1e-6)
    opt = section.optimizer(model)
    assert (opt.param_groups[0]["betas"], opt.param_groups[0]["eps"]) == ((0.9, 0.95), 1e-6)
    old = OptimSection(fused_optimizer=False).optimizer(model)
    old.load_state_dict(opt.state_dict() | {"param_groups": [dict(opt.param_groups[0], betas=(0.8, 0.9))]})
    section.reapply(old)
    assert old.param_groups[0]["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("name, value", [("time_shift", 3.0), ("cos_loss_weight", 1.0), ("adam_beta2", 0.95),
                                         ("adam_eps", 1e-6), ("adam_beta1", 0.8)])  # fmt: skip
def test_a_resume_that_changes_a_recipe_field_needs_allow_changes(name, value):
    from dit.train.config import TRAIN_FACE, resume_changes

    def changes(cfg):
        return resume_changes(TRAIN_FACE.flatten(cfg.record(), "run"), saved, cfg.checkpoint, "ckpt.pt")

    saved = TRAIN_FACE.flatten(TrainConfig.of().record(), "run")
    with pytest.raises(UserError, match=rf"ckpt.pt was trained with other settings: {name}: [^;]*\. A resume"):
        changes(TrainConfig.of(**{name: value}))
    assert changes(TrainConfig.of(**{name: value, "allow_changes": (name,)})) == []


def test_the_frontier_preset_stacks_the_recipes():
    from dit.train.config import resolve

    cfg = resolve(["--config", "configs/frontier.yaml"])
    assert (cfg.objective.objective, cfg.objective.time_sampling, cfg.objective.cos_loss_weight) == (
        "flow", "logit-normal", 1.0,
    )  # fmt: skip
    assert (cfg.optim.lr, cfg.optim.adam_beta2, cfg.optim.global_batch_size) == (2e-4, 0.95, 1024)
    assert (cfg.model.norm, cfg.model.mlp, cfg.model.rope, cfg.model.qk_norm) == ("rmsnorm", "swiglu", True, True)
    assert cfg.eval_sampling.time_shift == pytest.approx(1 / 0.3)  # LightningDiT's 0.3 on its axis


@pytest.mark.parametrize("objective", ["diffusion", "flow"])
def test_a_run_records_the_recipe_its_sampler_takes_it_and_a_resume_keeps_it(tmp_path, objective):
    from test_train import Pixels, tiny_config

    from dit.checkpoint import latest_checkpoint, load_checkpoint
    from dit.sample.loading import load_sampling_model
    from dit.train import train

    recipe = dict(objective=objective, time_shift=2.0, cos_loss_weight=0.5, adam_beta2=0.95, adam_eps=1e-6)
    train(tiny_config(tmp_path, max_steps=2, **recipe), Pixels())
    last = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert {(g["betas"][1], g["eps"]) for g in load_checkpoint(last)["optimizer"]["param_groups"]} == {
        (0.95, 1e-6)
    }
    sm = load_sampling_model(str(last), vae="none")
    assert Sampler(sm, 10).time_shift == 2.0 and Sampler(sm, 10, time_shift=1.0).time_shift == 1.0
    with pytest.raises(UserError, match=r"time_shift: 2\.0 -> 3\.0.*--allow-changes"):
        train(tiny_config(tmp_path, max_steps=4, resume="auto", **{**recipe, "time_shift": 3.0}), Pixels())
    changed = {**recipe, "time_shift": 3.0, "allow_changes": ["time_shift"]}
    assert train(tiny_config(tmp_path, max_steps=4, resume="auto", **changed), Pixels())["step"] == 4


def test_dit_cost_plans_the_shifted_steps(capsys):
    import json

    from dit.cost.__main__ import main

    def guided(*shift):
        flags = ["sample", "--model", "DiT-XL/2", "--sampler", "ddim", "--num-sampling-steps", "50",
                 "--guidance-scale", "4", "--guidance-interval", "0", "0.5", "--json", *shift]  # fmt: skip
        assert main(flags) == 0
        return json.loads(capsys.readouterr().out)["guided_nfe"]

    plan = sampling_plan("ddim", 50, guidance_scale=4, interval=(0, 0.5), time_shift=3.0)
    assert guided() == 25 and guided("--time-shift", "3") == plan.guided_nfe < 25  # fewer steps near the data
    assert guided("--time-shift", "auto") == 25  # SD-VAE latents at 256 px: RAE's shift is 1


def test_a_flow_sample_sets_identity_is_todays_without_the_recipe():
    from dit.objectives.transport import Transport

    today = {"path_type": "linear", "prediction": "velocity", "loss_weight": "none", "time_sampling": "uniform",
             "logit_mean": 0.0, "logit_std": 1.0, "train_eps": None, "sample_eps": None}  # fmt: skip
    assert flow_model().objective.manifest(None) == today
    shifted = type(flow_model().objective)(Transport(time_shift=3.0))
    assert shifted.manifest(None) == {**today, "time_shift": 3.0}
