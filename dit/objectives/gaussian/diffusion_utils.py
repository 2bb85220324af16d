"""Gaussian KL and the discretised-Gaussian likelihood used by the variational bound (ADM's definitions)."""

import math

import torch


def normal_kl(mean1, logvar1, mean2, logvar2):
    """KL(N(mean1, exp logvar1) || N(mean2, exp logvar2)) elementwise, in nats; arguments broadcast."""
    return 0.5 * (
        -1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2)
    )


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """A fast tanh approximation of the standard normal CDF (the one ADM's numbers were made with)."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def discretized_gaussian_log_likelihood(x, *, means, log_scales):
    """Log-likelihood of x in [-1, 1] in 256 bins under N(means, exp(log_scales)^2); outer bins reach +-inf."""
    centered_x = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered_x + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_stdv * (centered_x - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    cdf_delta = cdf_plus - cdf_min
    return torch.where(
        x < -0.999,
        log_cdf_plus,
        torch.where(x > 0.999, log_one_minus_cdf_min, torch.log(cdf_delta.clamp(min=1e-12))),
    )


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over all but the batch dimension."""
    return x.mean(dim=list(range(1, x.dim())))
