"""The determinism of the scripts that train the digit networks (classifier, judge, MAE encoder)."""

from __future__ import annotations

import torch


def seeded_script(seed: int) -> torch.Generator:
    """One thread, deterministic kernels and the seed (the same bytes every run on one machine); a generator."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
