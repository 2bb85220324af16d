"""Gaussian diffusion against independent closed forms."""

import math

import pytest
import torch

from dit.model.dit import DiT
from dit.objectives.gaussian import create_diffusion, space_timesteps


def linear_alpha_bar(t):
    """abar_t for the linear schedule, computed here from scratch in float64."""
    prod = 1.0
    for i in range(t + 1):
        prod *= 1.0 - (1e-4 + (0.02 - 1e-4) * i / 999)
    return prod


def test_schedule_tables_are_float64_and_official():
    d = create_diffusion("")
    assert d.num_timesteps == 1000 and d.betas.dtype.name == "float64"
    assert d.betas[0] == pytest.approx(1e-4) and d.betas[-1] == pytest.approx(0.02)
    assert d.alphas_cumprod[0] == pytest.approx(0.9999)
    assert d.alphas_cumprod[999] == pytest.approx(linear_alpha_bar(999), rel=1e-9)
    assert math.sqrt(d.alphas_cumprod[999]) == pytest.approx(0.00635, abs=1e-5)
    cos = create_diffusion("", noise_schedule="squaredcos_cap_v2")
    assert cos.betas.max() <= 0.999 and cos.alphas_cumprod[0] > 0.9999


def test_q_sample_moments():
    d = create_diffusion("")
    torch.manual_seed(0)
    x0 = torch.full((20000, 1, 1, 1), 0.7)
    t = torch.full((20000,), 300, dtype=torch.long)
    xt = d.q_sample(x0, t)
    ab = linear_alpha_bar(300)
    assert xt.mean().item() == pytest.approx(math.sqrt(ab) * 0.7, abs=0.02)
    assert xt.var().item() == pytest.approx(1 - ab, rel=0.03)


@pytest.mark.parametrize("t", [1, 2, 250, 999])
def test_posterior_matches_gaussian_product(t):
    """q(x_{t-1} | x_t, x_0) from Bayes' rule on N(sqrt(ab') x0, 1-ab') and N(sqrt(a) x_{t-1}, beta)."""
    d = create_diffusion("")
    x0 = torch.tensor([[[[0.3, -1.2]]]])
    xt = torch.tensor([[[[0.1, 0.9]]]])
    beta = 1e-4 + (0.02 - 1e-4) * t / 999
    ab_prev = linear_alpha_bar(t - 1)
    precision = 1 / (1 - ab_prev) + (1 - beta) / beta
    var = 1 / precision
    mean = var * (math.sqrt(ab_prev) * x0.double() / (1 - ab_prev) + math.sqrt(1 - beta) * xt.double() / beta)
    got_mean, got_var, got_logvar = d.q_posterior_mean_variance(x0, xt, torch.tensor([t]))
    torch.testing.assert_close(got_mean.double(), mean, rtol=1e-5, atol=1e-6)
    assert got_var.flatten()[0].item() == pytest.approx(var, rel=1e-6)
    assert got_logvar.flatten()[0].item() == pytest.approx(math.log(var), rel=1e-6)


def test_vb_is_zero_for_the_true_posterior_and_matches_kl_for_an_offset():
    d = create_diffusion("")
    torch.manual_seed(0)
    x0 = torch.rand(4, 2, 3, 3) * 1.6 - 0.8
    noise = torch.randn_like(x0)
    t = torch.tensor([1, 10, 500, 999])
    xt = d.q_sample(x0, t, noise)
    v_min = -torch.ones_like(x0)  # learned range at v = -1 is the posterior variance

    def vb_for(eps):
        out = torch.cat([eps, v_min], dim=1)
        return d._vb_terms_bpd(lambda *_, **__: out, x0, xt, t, clip_denoised=False)["output"]

    torch.testing.assert_close(vb_for(noise), torch.zeros(4), atol=1e-4, rtol=0)
    delta = 0.1
    got = vb_for(noise + delta)
    for i, ti in enumerate(t.tolist()):
        beta = 1e-4 + (0.02 - 1e-4) * ti / 999
        ab, ab_prev = linear_alpha_bar(ti), linear_alpha_bar(ti - 1)
        coef1 = beta * math.sqrt(ab_prev) / (1 - ab)
        mean_shift = coef1 * math.sqrt(1 / ab - 1) * delta
        post_var = beta * (1 - ab_prev) / (1 - ab)
        kl_bits = mean_shift**2 / (2 * post_var) / math.log(2)
        assert got[i].item() == pytest.approx(kl_bits, rel=2e-3)


def test_decoder_nll_at_t0():
    d = create_diffusion("")
    x0 = torch.tensor([0.5, -0.2, 0.999 + 1e-4]).view(1, 3, 1, 1)
    noise = torch.zeros_like(x0)
    t = torch.tensor([0])
    xt = d.q_sample(x0, t, noise)
    out = torch.cat([torch.zeros_like(x0), -torch.ones_like(x0)], dim=1)
    vb = d._vb_terms_bpd(lambda *_, **__: out, x0, xt, t, clip_denoised=False)["output"].item()

    def cdf(z):  # the tanh approximation to the normal CDF, written out independently
        return 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))

    # eps = 0 recovers x0 exactly, and at t = 0 the posterior mean coefficient on x0 is beta_0/(1-abar_0) = 1.
    s = math.sqrt(math.exp(d.posterior_log_variance_clipped[0]))
    nll = 0.0
    for x in (0.5, -0.2, 0.999 + 1e-4):
        mu = x
        if x > 0.999:
            p = 1 - cdf((x - 1 / 255 - mu) / s)
        else:
            p = cdf((x + 1 / 255 - mu) / s) - cdf((x - 1 / 255 - mu) / s)
        nll += -math.log(max(p, 1e-12))
    assert vb == pytest.approx(nll / 3 / math.log(2), rel=1e-4)


def test_respacing_sets():
    assert sorted(space_timesteps(1000, "250"))[:3] == [0, 4, 8]
    assert sorted(space_timesteps(1000, "250"))[-3:] == [991, 995, 999]
    assert len(space_timesteps(1000, "250")) == 250
    assert sorted(space_timesteps(1000, "ddim50")) == list(range(0, 1000, 20))
    assert sorted(space_timesteps(1000, "50"))[:4] == [0, 20, 41, 61]
    d = create_diffusion("250")
    assert d.num_timesteps == 250 and d.timestep_map[-1] == 999
    assert d.alphas_cumprod[-1] == pytest.approx(create_diffusion("").alphas_cumprod[999], rel=1e-12)


def test_model_sees_original_timesteps_when_respaced():
    d = create_diffusion("10")
    seen = []

    def model(x, t, **kw):
        seen.append(t.tolist())
        return torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:])

    d.p_sample_loop(model, (1, 1, 2, 2), device="cpu")
    assert seen[0] == [999] and seen[-1] == [0] and len(seen) == 10


def test_tables_are_uploaded_once_per_device():
    d = create_diffusion("")
    first = d.tables("cpu")
    assert first["posterior_mean_coef1"].dtype == torch.float64
    d.training_losses(
        lambda x, t, **k: torch.zeros(x.shape[0], 8, 2, 2), torch.zeros(2, 4, 2, 2), torch.tensor([0, 5])
    )
    assert d.tables("cpu") is first


def tiny_model():
    return DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2, num_classes=4)


def test_losses_per_sample_and_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = tiny_model()
    d = create_diffusion("")
    x = torch.randn(8, 4, 8, 8)
    y = torch.arange(8) % 4
    t = torch.randint(0, 1000, (8,))
    noise = torch.randn_like(x)
    terms = d.training_losses(model, x, t, dict(y=y), noise=noise)
    assert set(terms) == {"loss", "mse", "vb"} and terms["loss"].shape == (8,)
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = d.training_losses(model, x, t, dict(y=y), noise=noise)["loss"].mean().item()
    for _ in range(150):
        loss = d.training_losses(model, x, t, dict(y=y), noise=noise)["loss"].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * start


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_samplers_are_deterministic_under_a_seed(sampler):
    model = tiny_model().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    d = create_diffusion("ddim10" if sampler == "ddim" else "10")
    loop = d.ddim_sample_loop if sampler == "ddim" else d.p_sample_loop
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        z = torch.randn(3, 4, 8, 8)
        kwargs = dict(y=torch.tensor([0, 1, 2]))
        runs.append(loop(model, z.shape, z, clip_denoised=False, model_kwargs=kwargs, progress=False))
    assert runs[0].shape == (3, 4, 8, 8)
    assert torch.equal(runs[0], runs[1]) and torch.isfinite(runs[0]).all()


# ---- Min-SNR weighting and logit-normal timesteps -------------------------------------------------------


@pytest.mark.parametrize("predict_xstart", [False, True], ids=["eps", "x0"])
def test_min_snr_weight_against_hand_computation(predict_xstart):
    """Hang et al. 2023: min(SNR, gamma) / SNR on the noise error, min(SNR, gamma) on the x0 error."""
    t = torch.tensor([0, 10, 100, 400, 999])
    x0 = torch.full((5, 2, 2, 2), 0.3)
    noise = torch.randn(5, 2, 2, 2, generator=torch.Generator().manual_seed(0))
    out = torch.zeros(5, 4, 2, 2)  # a model that predicts 0 (learned-variance channels at 0 too)
    plain = create_diffusion("", predict_xstart=predict_xstart)
    weighted = create_diffusion("", predict_xstart=predict_xstart, loss_weighting="min-snr", min_snr_gamma=4.0)
    a, b = (d.training_losses(lambda *_, **__: out, x0, t, noise=noise) for d in (plain, weighted))
    torch.testing.assert_close(b["mse"], a["mse"])
    torch.testing.assert_close(b["vb"], a["vb"])  # the learned-variance term is not weighted
    for i, ti in enumerate(t.tolist()):
        snr = linear_alpha_bar(ti) / (1 - linear_alpha_bar(ti))
        weight = min(snr, 4.0) if predict_xstart else min(snr, 4.0) / snr
        assert b["loss"][i].item() == pytest.approx(weight * a["mse"][i].item() + a["vb"][i].item(), rel=1e-5)
    assert weighted.min_snr_gamma == 4.0 and create_diffusion("", loss_weighting="min-snr").min_snr_gamma == 5.0


def test_uniform_timesteps_are_the_official_draw_bit_for_bit():
    d = create_diffusion("")
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for batch in (1, 7, 256):
        assert torch.equal(d.sample_t(batch, g1, "cpu"), torch.randint(0, 1000, (batch,), generator=g2))
    assert torch.equal(g1.get_state(), g2.get_state())  # the draws that follow are the same too


@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (1.0, 1.0), (-0.5, 0.5)])
def test_logit_normal_timesteps_have_the_expected_quantiles(mean, std):
    """step = floor((1 - u) T), u = sigmoid(N(m, s)): step quantile q is T (1 - sigmoid(m + s z_{1-q}))."""
    d = create_diffusion("", timestep_sampling="logit-normal", logit_mean=mean, logit_std=std)
    t = d.sample_t(200_000, torch.Generator().manual_seed(0), "cpu")
    assert t.dtype == torch.long and 0 <= t.min() and t.max() <= 999
    for q, z in ((0.25, 0.6745), (0.5, 0.0), (0.75, -0.6745)):
        expected = 1000 * (1 - 1 / (1 + math.exp(-(mean + std * z))))
        assert abs(t.double().quantile(q).item() - expected) < 4, q
    respaced = create_diffusion("250", timestep_sampling="logit-normal")  # its own step count
    assert respaced.sample_t(10_000, torch.Generator().manual_seed(0)).max() < 250


def test_timestep_options_make_no_host_sync():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    d = create_diffusion("", loss_weighting="min-snr", timestep_sampling="logit-normal")
    d.tables("cpu")
    x = torch.randn(4, 4, 2, 2)
    with Reads() as reads:
        t = d.sample_t(4, torch.Generator().manual_seed(0), "cpu")
        d.training_losses(lambda x, t, **k: torch.zeros(x.shape[0], 8, 2, 2), x, t)["loss"].mean()
    assert reads.count == 0


@pytest.mark.parametrize(
    "options",
    [dict(loss_weighting="min-snr"), dict(loss_weighting="min-snr", predict_xstart=True),
     dict(timestep_sampling="logit-normal")],
    ids=["min-snr-eps", "min-snr-x0", "logit-normal"],
)  # fmt: skip
def test_tiny_model_trains_with_each_timestep_option(options):
    """Fresh timesteps (from sample_t) and noise every step; the loss on a fixed set of draws falls."""
    torch.manual_seed(0)
    model, d = tiny_model(), create_diffusion("", **options)
    x, y = torch.randn(8, 4, 8, 8), torch.arange(8) % 4
    g = torch.Generator().manual_seed(1)
    held = [(d.sample_t(8, g), torch.randn(x.shape, generator=g)) for _ in range(4)]

    def held_loss():
        with torch.no_grad():
            return sum(d.training_losses(model, x, t, dict(y=y), noise=n)["loss"].mean().item() for t, n in held)

    start = held_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = d.training_losses(model, x, d.sample_t(8, g), dict(y=y))["loss"].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert held_loss() < 0.5 * start


def test_timestep_options_keep_the_official_api_and_check_their_values():
    d = create_diffusion("", "squaredcos_cap_v2", False, False, True, False, False, 1000)  # official positions
    assert (d.loss_weighting, d.timestep_sampling, d.mse_weight) == ("none", "uniform", None)
    with pytest.raises(TypeError):
        create_diffusion("", "linear", False, False, False, True, False, 1000, "min-snr")  # keyword-only
    for kwargs, match in [
        (dict(loss_weighting="p2"), "loss_weighting 'p2'"),
        (dict(timestep_sampling="cosine"), "timestep_sampling 'cosine'"),
        (dict(loss_weighting="min-snr", min_snr_gamma=0.0), "min_snr_gamma"),
        (dict(timestep_sampling="logit-normal", logit_std=-1.0), "logit_std"),
    ]:
        with pytest.raises(ValueError, match=match):
            create_diffusion("", **kwargs)
