"""``create_diffusion``: DiT's Gaussian diffusion from the official arguments."""

from dit.objectives.gaussian import gaussian_diffusion as gd
from dit.objectives.gaussian.respace import SpacedDiffusion, space_timesteps
from dit.objectives.respacing import shift_timesteps


def create_diffusion(
    timestep_respacing,
    noise_schedule="linear",
    use_kl=False,
    sigma_small=False,
    predict_xstart=False,
    learn_sigma=True,
    rescale_learned_sigmas=False,
    diffusion_steps=1000,
    *,
    time_shift=1.0,
    **recipe,
) -> SpacedDiffusion:
    """The DiT diffusion (linear betas, 1000 steps, epsilon, learned range), respaced by ``timestep_respacing``."""
    betas = gd.get_named_beta_schedule(noise_schedule, diffusion_steps)
    if use_kl:
        loss_type = gd.LossType.RESCALED_KL
    elif rescale_learned_sigmas:
        loss_type = gd.LossType.RESCALED_MSE
    else:
        loss_type = gd.LossType.MSE
    if timestep_respacing is None or timestep_respacing == "":
        timestep_respacing = [diffusion_steps]
    if learn_sigma:
        var_type = gd.ModelVarType.LEARNED_RANGE
    else:
        var_type = gd.ModelVarType.FIXED_SMALL if sigma_small else gd.ModelVarType.FIXED_LARGE
    kept = space_timesteps(diffusion_steps, timestep_respacing)
    return SpacedDiffusion(
        use_timesteps=kept if len(kept) == diffusion_steps else shift_timesteps(kept, time_shift, diffusion_steps),
        time_shift=time_shift,
        betas=betas,
        model_mean_type=gd.ModelMeanType.START_X if predict_xstart else gd.ModelMeanType.EPSILON,
        model_var_type=var_type,
        loss_type=loss_type,
        **recipe,
    )
