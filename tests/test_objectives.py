"""One Objective interface: diffusion and flow implement it, and nothing outside dit/objectives asks which."""

import re
from pathlib import Path

import pytest
import torch

from dit.io.errors import UserError
from dit.model.config import DiTConfig
from dit.objectives import OBJECTIVES, Objective, from_record, objective_for_sampler
from dit.objectives.samplers import SAMPLERS
from dit.objectives.section import ObjectiveSection

ROOT = Path(__file__).resolve().parents[1]
# A branch on which objective a run has: the flag, the name compared, a missing transport, a type test.
# Also a branch on a sampler's family (diffusion's loops, diffusers' schedulers, the flow's ODE/SDE).
BRANCH = re.compile(
    r"\.flow\b|transport is (not )?None|objective\s*[!=]=|[!=]=\s*[\"'](flow|diffusion)[\"']"
    r"|isinstance\([^)]*(Diffusion|Transport|Objective)|\bif (not )?flow\b|\bflow\s*=\s*[^=]"
    r"|\bin\s+(DIFFUSION|SCHEDULER|FLOW)_SAMPLERS|[!=]=\s*[\"'](ode|sde|ddpm|ddim)[\"']|[\"'](ode|sde)-[\"']"
)
# The objectives, what they wrap (gaussian/, transport/) and the sampler registry (samplers.py).
OWNERS = ("dit/objectives/",)


def test_the_branch_pattern_finds_the_branches_it_replaced():
    old = ['if not cfg.objective.flow:', 'Sampler(sm, 50, "ddim" if sm.transport is None else "ode")',
           'flow = objective == "flow"', 'if run.get("objective") == "flow":',
           'elif self.kind in DIFFUSION_SAMPLERS:', 'if self.kind == "ode":',
           '"sde": [s.diffusion_form, s.last_step] if sampler.kind == "sde" else None',
           'spec.partition("-") if spec.startswith(("ode-", "sde-")) else (spec, "", "")']  # fmt: skip
    assert all(BRANCH.search(line) for line in old)
    assert not BRANCH.search("self.objective.tables(device)")


def test_nothing_outside_the_objectives_branches_on_which_one_it_is():
    files = [*(ROOT / "dit").rglob("*.py"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "studies").glob("*.py")]
    files += ROOT.glob("*.py")
    found = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(OWNERS):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if BRANCH.search(code):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "move these into an Objective (dit/objectives):\n" + "\n".join(found)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_each_objective_implements_the_interface(name):
    cls = OBJECTIVES[name]
    assert issubclass(cls, Objective) and cls.name == name
    assert {cls.default_sampler, cls.fast_sampler} <= set(cls.samplers)
    assert objective_for_sampler(cls.default_sampler) is cls
    obj = ObjectiveSection(objective=name).build(DiTConfig(learn_sigma=cls.learns_sigma))
    assert isinstance(obj, cls) and obj.tables("cpu") is obj
    assert type(from_record({"objective": name}, cls.learns_sigma, 4 * 32 * 32)) is cls
    out_channels = obj.model_outputs(4, learn_sigma=True)
    assert out_channels == (8 if cls.learns_sigma else 4)

    def model_fn(x, t, y):
        return torch.cat([x] * (out_channels // x.shape[1]), dim=1) * 0.5

    g = torch.Generator().manual_seed(0)
    t = obj.sample_t(6, g, "cpu")
    assert t.shape == (6,) and torch.equal(t, obj.sample_t(6, torch.Generator().manual_seed(0), "cpu"))
    x, noise = torch.randn(6, 4, 2, 2, generator=g), torch.randn(6, 4, 2, 2, generator=g)
    loss = obj.training_losses(model_fn, x, t, {"y": torch.zeros(6, dtype=torch.long)}, noise=noise)["loss"]
    assert loss.shape == (6,) and torch.isfinite(loss).all()
    other = next(s for s in SAMPLERS if s not in cls.samplers)
    with pytest.raises(UserError, match=f"does not sample a {cls.noun} model"):
        obj.sampler(other)
    t0, t1 = obj.sampling_interval(None)
    assert 0 <= t0 < t1 <= 1


def test_every_sampler_samples_exactly_one_objective():
    owners = [[n for n, o in OBJECTIVES.items() if s in o.samplers] for s in SAMPLERS]
    assert all(len(o) == 1 for o in owners), dict(zip(SAMPLERS, owners))


def test_both_objectives_draw_the_same_logit_normal_times():
    """One draw: the diffusion's step is floor((1 - u) T) of the flow's time u from the same generator."""
    opts = {"time_sampling": "logit-normal", "logit_mean": 0.3, "logit_std": 1.2}
    diffusion = ObjectiveSection(**opts).build(DiTConfig())
    flow = ObjectiveSection(objective="flow", **opts).build(DiTConfig(learn_sigma=False))
    u = flow.sample_t(1000, torch.Generator().manual_seed(1), "cpu")
    steps = diffusion.sample_t(1000, torch.Generator().manual_seed(1), "cpu")
    assert torch.equal(steps, ((1.0 - u) * 1000).long().clamp(0, 999)) and steps.unique().numel() > 100
