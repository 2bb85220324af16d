"""The analytic counts against FlopCounterMode (meta and CPU) and fvcore with an SDPA handle."""

import dataclasses

import pytest
import torch
from helpers import block_option_sets
from torch.utils.flop_counter import FlopCounterMode

from dit.cost.analytic import ATTENTION_COMPONENTS, forward_macs, param_counts, training_flops_per_image
from dit.cost.measured import fvcore_forward_macs, measure_flops
from dit.model.config import DiTConfig, model_config
from dit.model.dit import DiT

CUSTOM = DiTConfig(
    depth=4,
    hidden_size=192,
    num_heads=3,
    patch_size=4,
    input_size=48,
    in_channels=3,
    num_classes=10,
    learn_sigma=False,
)
# Attention-heavy (256 tokens, width 64), so the fused-attention recompute is a large, visible term.
TINY = DiTConfig(depth=2, hidden_size=64, num_heads=4, patch_size=2, input_size=32, num_classes=10)

CONFIGS = {
    "S/2": model_config("DiT-S/2"),
    "B/4": model_config("DiT-B/4"),
    "XL/2": model_config("DiT-XL/2"),
    "XL/2@512": model_config("DiT-XL/2", input_size=64),
    "S/1": model_config("DiT-S/1"),
    "B/1-vavae": model_config("DiT-B/1", input_size=16, in_channels=32, learn_sigma=False),
    "custom": CUSTOM,
}


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_meta_forward_is_twice_the_analytic_macs_and_training_is_three_times(cfg):
    measured = measure_flops(cfg, batch_size=2)
    analytic = forward_macs(cfg)
    assert abs(measured["forward_flops_per_image"] / analytic.flops - 1) < 1e-3
    for name, flops in measured["forward_components"].items():
        macs = analytic.attention if name == "attention" else analytic.components[name]
        assert abs(flops - 2 * macs) <= 1e-3 * 2 * macs, name
    assert round(measured["train_flops_per_image"] / measured["forward_flops_per_image"], 2) == 3.00
    train = training_flops_per_image(cfg, fused_attention=False)
    assert measured["train_flops_per_image"] == train.model - _skipped_input_grads(cfg)


def _skipped_input_grads(cfg: DiTConfig) -> int:
    """Backward is 2 x forward except the input gradients nobody needs: latents into the patch embed and
    sinusoid features into the timestep MLP (the model convention counts them; < 0.2% even for tiny models)."""
    return 2 * (forward_macs(cfg).components["patch_embed"] + cfg.frequency_embedding_size * cfg.hidden_size)


@pytest.mark.parametrize("blocks", [1, 12], ids=["one-block", "all-blocks"])
def test_checkpointed_recompute_is_counted_as_predicted(blocks):
    cfg = model_config("DiT-B/2")
    measured = measure_flops(cfg, batch_size=1, checkpointed_blocks=blocks)
    predicted = training_flops_per_image(cfg, checkpointed_blocks=blocks, fused_attention=False)
    assert measured["train_flops_per_image"] == predicted.hardware - _skipped_input_grads(cfg)
    assert measured["train_flops_per_image"] > 1.01 * predicted.model  # the recompute is really there


def test_cpu_with_fused_sdpa_formulas_counts_hardware_flops():
    # Real CPU tensors, flash-attention formulas: what a GPU with fused SDPA executes, recompute included.
    measured = measure_flops(TINY, batch_size=2, checkpointed_blocks=1, device="cpu")
    assert abs(measured["forward_flops_per_image"] / forward_macs(TINY).flops - 1) < 1e-3
    fused = training_flops_per_image(TINY, checkpointed_blocks=1, fused_attention=True)
    plain = training_flops_per_image(TINY, checkpointed_blocks=1, fused_attention=False)
    assert measured["train_flops_per_image"] == fused.hardware - _skipped_input_grads(TINY)
    assert fused.hardware > 1.05 * plain.hardware  # so the test above can tell the two apart


def test_plain_cpu_count_misses_attention_unless_torch_fixed_it():
    """The trap measure_flops avoids: on CPU, FlopCounterMode counts SDPA as 0 (pytorch#195460, torch 2.14)."""
    model = DiT.from_config(TINY).eval()
    inputs = (torch.randn(2, 4, 32, 32), torch.randint(0, 1000, (2,)), torch.randint(0, 10, (2,)))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*inputs)
    analytic = forward_macs(TINY)
    if counter.get_total_flops() / 2 == analytic.flops:
        pytest.skip(f"torch {torch.__version__} counts CPU SDPA: the trap measure_flops avoids is gone")
    missing = 2 * sum(analytic.components[k] for k in ATTENTION_COMPONENTS)
    assert counter.get_total_flops() / 2 == analytic.flops - missing


def test_fvcore_with_sdpa_handle_agrees_once_layernorm_is_set_aside():
    cfg = model_config("DiT-S/4")
    counted = fvcore_forward_macs(cfg)
    analytic = forward_macs(cfg)
    assert abs((counted["total"] - counted["layer_norm"]) / analytic.total - 1) < 1e-4
    assert counted["attention"] == analytic.attention
    assert counted["layer_norm"] > 0 and "aten::scaled_dot_product_attention" not in counted["unsupported"]
    shipped = fvcore_forward_macs(cfg, sdpa_handle=False)  # fvcore as it comes: attention silently lost
    assert shipped["total"] - shipped["layer_norm"] == pytest.approx(analytic.total - analytic.attention, rel=1e-4)
    assert "aten::scaled_dot_product_attention" in shipped["unsupported"]


# Each block option alone and all together. Only SwiGLU changes a matmul; norms, RoPE, QK-norm and the gate
# product are elementwise, which neither the formulas nor FlopCounterMode count: the counts are equal, exactly.
BLOCK_OPTIONS = block_option_sets()


@pytest.mark.parametrize("options", BLOCK_OPTIONS.values(), ids=BLOCK_OPTIONS.keys())
@pytest.mark.parametrize("name", ["DiT-S/2", "DiT-L/4", "DiT-XL/2", "DiT-XL/1"])
def test_block_options_meta_count_equals_the_analytic_one(name, options):
    """XL/1 on 16x16 latents: LightningDiT's model on VA-VAE's 32 channels."""
    latents = dict(input_size=16, in_channels=32) if name.endswith("/1") else {}
    cfg = model_config(name, **latents, **options)
    measured = measure_flops(cfg, batch_size=2, checkpointed_blocks=2)
    analytic = forward_macs(cfg)
    assert measured["forward_flops_per_image"] == analytic.flops
    for component, flops in measured["forward_components"].items():
        assert flops == 2 * (analytic.attention if component == "attention" else analytic.components[component])
    predicted = training_flops_per_image(cfg, checkpointed_blocks=2, fused_attention=False)
    assert measured["train_flops_per_image"] == predicted.hardware - _skipped_input_grads(cfg)


def test_a_new_block_option_is_one_registry_entry(monkeypatch):
    """An MLP entry added to the registry alone (here GELU at twice the width) builds, is counted by the cost
    and memory models through its own terms, and the counts equal the meta-device model's."""
    from dit.cost.memory import estimate_training_memory
    from dit.model import options

    wide = dataclasses.replace(options.MLPS["gelu"], width=lambda w: 2 * w)
    monkeypatch.setitem(options.MLPS, "wide", wide)
    base, cfg = model_config("DiT-S/2"), model_config("DiT-S/2", mlp="wide")
    assert cfg.mlp_hidden == 2 * base.mlp_hidden and cfg.block_options == ["wide"]
    with torch.device("meta"):
        assert param_counts(cfg).total == sum(p.numel() for p in DiT.from_config(cfg).parameters())
    assert forward_macs(cfg).components["mlp"] == 2 * forward_macs(base).components["mlp"]
    assert measure_flops(cfg, batch_size=2)["forward_flops_per_image"] == forward_macs(cfg).flops
    assert estimate_training_memory(cfg, 8, "bf16").total > estimate_training_memory(base, 8, "bf16").total


def test_swiglu_changes_the_mlp_count_by_its_width():
    gelu, swiglu = (forward_macs(model_config("DiT-L/2", mlp=m)).components["mlp"] for m in ("gelu", "swiglu"))
    assert swiglu / gelu == 3 * 2728 / (2 * 4096)  # 2728 = 2/3 of 4096, to a multiple of 8


def test_block_options_on_cpu_with_fused_sdpa_formulas():
    cfg = DiTConfig(**{**TINY.to_dict(), **BLOCK_OPTIONS["all"]})
    measured = measure_flops(cfg, batch_size=2, checkpointed_blocks=1, device="cpu")
    assert measured["forward_flops_per_image"] == forward_macs(cfg).flops
    fused = training_flops_per_image(cfg, checkpointed_blocks=1, fused_attention=True)
    assert measured["train_flops_per_image"] == fused.hardware - _skipped_input_grads(cfg)
