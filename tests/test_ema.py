"""The EMA update: the reference formula, the on-device skip, and what CUDA's fused foreach kernel needs."""

import pytest
import torch
from helpers import tiny_dit

import dit.train.ema as ema_mod
from dit.train.ema import EMA


def _recording(monkeypatch) -> list:
    calls, real = [], torch._foreach_lerp_

    def record(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(torch, "_foreach_lerp_", record)
    return calls


@pytest.mark.parametrize("apply", [None, 1.0, 0.0])
def test_the_update_is_the_formula_and_hands_the_foreach_op_dense_tensors_only(monkeypatch, apply):
    """The CPU takes CUDA's path here: its foreach ops are per-tensor loops, so only the arguments can be checked."""
    monkeypatch.setattr(ema_mod, "FUSED_FOREACH", ("cuda", "cpu"))
    model = tiny_dit(0)
    ema = EMA(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    before = {k: v.clone() for k, v in ema.model.state_dict().items()}
    calls = _recording(monkeypatch)
    ema.update(model, apply=None if apply is None else torch.tensor(apply))
    assert len(calls) == 1  # one foreach op over every parameter
    for arg in calls[0]:
        for t in arg if isinstance(arg, list) else ():
            # CUDA's fast path: dense, non-overlapping (an expanded 0-dim weight has stride 0 and falls back)
            assert t.is_contiguous() and 0 not in t.stride() or t.numel() <= 1, t.stride()
    if apply is not None:
        assert [w.shape for w in calls[0][2]] == [p.shape for p in ema.model.parameters()]
    current = model.state_dict()
    for k, v in ema.model.state_dict().items():
        expected = before[k] if apply == 0.0 else before[k] + 0.1 * (current[k] - before[k])
        torch.testing.assert_close(v, expected, rtol=1e-6, atol=1e-7, msg=k)
    assert apply == 0.0 or any(not torch.equal(v, before[k]) for k, v in ema.model.state_dict().items())


@pytest.mark.parametrize("fused", [("cuda",), ("cuda", "cpu")])
def test_a_skipped_step_leaves_the_ema_bit_identical_and_the_weights_follow_apply(monkeypatch, fused):
    monkeypatch.setattr(ema_mod, "FUSED_FOREACH", fused)
    model = tiny_dit(0)
    ema = EMA(model, decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    before = [p.clone() for p in ema.model.parameters()]
    ema.update(model, apply=torch.tensor(0.0))
    assert all(torch.equal(a, b) for a, b in zip(ema.model.parameters(), before))
    ema.update(model, apply=torch.tensor(1.0))
    for a, b, m in zip(ema.model.parameters(), before, model.parameters()):
        torch.testing.assert_close(a, torch.lerp(b, m, 0.5))
