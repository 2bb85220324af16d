"""The precision policy's process-wide flags: every backend set consistently, and restored."""

import pytest
import torch

from dit.runtime.precision import PRECISIONS, Precision, reference


def _per_operator() -> dict:
    b = torch.backends
    ops = {
        "cuda.matmul": b.cuda.matmul,
        "cudnn.conv": b.cudnn.conv,
        "cudnn.rnn": b.cudnn.rnn,
        "mkldnn.matmul": b.mkldnn.matmul,
        "mkldnn.conv": b.mkldnn.conv,
        "mkldnn.rnn": b.mkldnn.rnn,
    }
    return {name: op.fp32_precision for name, op in ops.items()}


def _legacy() -> tuple:
    """What Inductor and older code read: each raises once the legacy and per-operator settings disagree."""
    b = torch.backends
    return b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, torch.get_float32_matmul_precision()


@pytest.mark.parametrize("name", PRECISIONS)
def test_flags_set_every_backend_so_the_legacy_getters_read(name):
    before, legacy_before = _per_operator(), _legacy()
    with Precision(name, "cuda").flags():  # fp16 is refused on the CPU only at construction; flags need no device
        tf32 = name == "tf32"
        assert _legacy() == (tf32, tf32, "high" if tf32 else "highest")
        assert set(_per_operator().values()) == {"tf32" if tf32 else "ieee"}
    assert _per_operator() == before and _legacy() == legacy_before


def test_a_precision_is_one_of_the_named_policies():
    """A face's --precision is checked at its field; a library caller's other name has no policy."""
    dtypes = [Precision(name, "cuda").amp_dtype for name in PRECISIONS]
    assert dtypes == [None, None, torch.bfloat16, torch.float16]
    with pytest.raises(KeyError, match="fp8"):
        Precision("fp8")


def test_flags_nest_and_restore_a_callers_own_setting():
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # the caller's own half-set state (the legacy getter raises)
    try:
        before = _per_operator()
        with Precision("tf32").flags(), reference("cpu"):  # the evaluators' float32 inside a tf32 run
            assert _legacy() == (False, False, "highest")
        assert _per_operator() == before
    finally:
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # torch's default
    assert _legacy()[1] is True


def test_frozen_networks_run_in_the_runs_precision_and_evaluators_in_float32():
    w, x = torch.randn(8, 8), torch.randn(4, 8)
    assert (x @ w).dtype == torch.float32
    for name, dtype in (("fp32", torch.float32), ("tf32", torch.float32), ("bf16", torch.bfloat16)):
        with Precision(name).frozen():
            assert (x @ w).dtype == dtype
            with reference("cpu"):
                assert (x @ w).dtype == torch.float32


def _output_dtypes(module: torch.nn.Module) -> list[torch.dtype]:
    """The output dtypes of every convolution and linear layer in ``module``, as they run (forward hooks)."""
    seen = []
    for layer in module.modules():
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
            layer.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    return seen


def test_a_runs_decode_is_in_its_precision_and_its_judge_in_float32():
    """The images of a run's grids and evaluations (``generate``) are decoded in the run's precision (bf16
    matmuls in a bf16 run, not IEEE float32); the judge that scores them keeps IEEE float32 in the same run."""
    from helpers import TINY, build_tiny_vae, randomize

    from dit.eval.digit_nets import load_digit_classifier
    from dit.model.dit import DiT
    from dit.sample.generate import Sampler, SamplingModel, generate

    vae = build_tiny_vae()
    decoded = _output_dtypes(vae.decoder)
    sm = SamplingModel(randomize(DiT(**TINY), 0).eval(), "random", 8 * TINY["input_size"], vae, "tiny")
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        decoded.clear()
        images = generate(sm, Sampler(sm, 2), [0, 1], [0, 1], precision=Precision(name))
        assert images.dtype == torch.float32 and decoded and set(decoded) == {dtype}
    judge = load_digit_classifier()
    judged = _output_dtypes(judge)
    with Precision("bf16").frozen():  # the run's arithmetic all around it
        features = judge(torch.randint(0, 256, (2, 3, 28, 28), dtype=torch.uint8))
    assert judged and set(judged) == {torch.float32}
    assert {f.dtype for f in features.values()} == {torch.float32}
