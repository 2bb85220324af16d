"""The DiT against the ground truth in tests/data (copied from the spec) and the official semantics."""

import math

import numpy as np
import pytest
import torch
from helpers import DATA, spec_rows

from dit.io.errors import UserError
from dit.model.config import _SIZES, PATCH_SIZES, DiTConfig, describe, model_config, model_names
from dit.model.dit import DiT, DiT_models
from dit.model.layers import (
    ATTENTION_BACKENDS,
    HeadRMSNorm,
    _RMSNormWeighted,
    apply_rope,
    attention_kernel,
    rope_2d,
    sincos_2d,
)
from dit.train.parallel import parallelize


def meta_model(name, image_size=256):
    with torch.device("meta"):
        return DiT_models[name](input_size=image_size // 8)


def tiny(**kw):
    args = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=10)
    args.update(kw)
    return DiT(**args)


def test_registry_has_every_size_at_every_patch():
    assert list(DiT_models) == list(model_names()) and len(set(model_names())) == len(_SIZES) * len(PATCH_SIZES)
    assert {"DiT-XL/1", "DiT-S/1", "DiT-XL/2", "DiT-S/8"} <= set(DiT_models)
    assert model_config("DiT-L/4").hidden_size == 1024 and model_config("DiT-L/4").depth == 24


@pytest.mark.parametrize("row", spec_rows(), ids=lambda r: f"{r['model']}@{r['image_size']}")
def test_parameter_counts_match_spec(row):
    model = meta_model(row["model"], int(row["image_size"]))
    assert sum(p.numel() for p in model.parameters()) == int(row["params_total"])
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == int(row["params_trainable"])
    assert model.config.tokens == int(row["tokens"])


def test_state_dict_keys_and_shapes_equal_official_xl2():
    expected = []
    for line in (DATA / "official_dit_xl2_state_dict.txt").read_text().splitlines():
        name, shape = line.split(" ", 1)
        expected.append((name, tuple(int(s) for s in shape.strip("[]").split(","))))
    got = [(k, tuple(v.shape)) for k, v in meta_model("DiT-XL/2").state_dict().items()]
    assert got == expected


def test_output_is_exactly_zero_at_init():
    model = tiny().eval()
    out = model(torch.randn(3, 4, 8, 8), torch.tensor([0, 500, 999]), torch.tensor([0, 3, 10]))
    assert out.shape == (3, 8, 8, 8)
    assert torch.count_nonzero(out) == 0


def test_patchify_unpatchify_round_trip():
    model = tiny(learn_sigma=False)
    p, c = model.patch_size, model.out_channels
    x = torch.randn(2, c, 8, 8)
    # patchify in the (p, q, c) feature order of the output linear, then undo it
    tokens = x.reshape(2, c, 4, p, 4, p).permute(0, 2, 4, 3, 5, 1).reshape(2, 16, p * p * c)
    assert torch.equal(model.unpatchify(tokens), x)


def test_positional_embedding_matches_formula():
    dim, grid = 16, 3
    table = sincos_2d(dim, grid)
    quarter = dim // 4
    for token in range(grid * grid):
        row, col = divmod(token, grid)
        for half, pos in ((0, col), (1, row)):  # first half: column, second half: row
            for i in range(quarter):
                omega = 1.0 / 10000 ** (i / quarter)
                assert table[token, half * dim // 2 + i] == pytest.approx(math.sin(pos * omega), abs=1e-12)
                assert table[token, half * dim // 2 + quarter + i] == pytest.approx(
                    math.cos(pos * omega), abs=1e-12
                )
    model = tiny()
    assert not model.pos_embed.requires_grad
    np.testing.assert_allclose(model.pos_embed[0].numpy(), sincos_2d(32, 4).astype(np.float32))


def test_label_dropout_only_in_train_mode():
    model = tiny(class_dropout_prob=0.5)
    labels = torch.zeros(2000, dtype=torch.long)
    torch.manual_seed(0)
    emb_train = model.y_embedder(labels, train=True)
    null = model.y_embedder.embedding_table.weight[10]
    dropped = (emb_train == null).all(dim=1).float().mean().item()
    assert 0.45 < dropped < 0.55
    emb_eval = model.y_embedder(labels, train=False)
    assert not (emb_eval == null).all(dim=1).any()
    assert model.y_embedder.embedding_table.num_embeddings == 11


def randomize(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    return model


def test_cfg_guides_first_three_channels_and_never_variance():
    model = randomize(tiny()).eval()
    x = torch.randn(2, 4, 8, 8)
    x = torch.cat([x[:1], x[:1]])
    t = torch.tensor([10, 10])
    y = torch.tensor([3, 10])
    out = model.forward_with_cfg(x, t, y, cfg_scale=4.0)
    raw = model(x, t, y)
    cond, uncond = raw.chunk(2)
    expected = uncond[:, :3] + 4.0 * (cond[:, :3] - uncond[:, :3])
    torch.testing.assert_close(out[:1, :3], expected)
    torch.testing.assert_close(out[1:, :3], expected)
    torch.testing.assert_close(out[:, 3:], raw[:, 3:])  # channel 3 and the variance pass through
    out_all = model.forward_with_cfg(x, t, y, cfg_scale=4.0, cfg_channels="all")
    torch.testing.assert_close(out_all[:1, :4], uncond[:, :4] + 4.0 * (cond[:, :4] - uncond[:, :4]))
    torch.testing.assert_close(out_all[:, 4:], raw[:, 4:])


def test_cfg_on_one_channel_model_leaves_variance_alone():
    model = randomize(tiny(in_channels=1)).eval()
    x = torch.randn(1, 1, 8, 8).repeat(2, 1, 1, 1)
    t, y = torch.tensor([5, 5]), torch.tensor([1, 10])
    out = model.forward_with_cfg(x, t, y, cfg_scale=3.0)
    raw = model(x, t, y)
    torch.testing.assert_close(out[:, 1:], raw[:, 1:])
    assert not torch.allclose(out[:1, :1], raw[:1, :1])


def test_activation_checkpointing_keeps_gradients():
    torch.manual_seed(0)
    model = randomize(tiny(class_dropout_prob=0.0))
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 900]), torch.tensor([1, 2])
    model(x, t, y).square().mean().backward()
    ref = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    model.set_checkpointing("all")
    assert model.num_checkpointed_blocks == 2
    model(x, t, y).square().mean().backward()
    for a, p in zip(ref, [p for p in model.parameters() if p.requires_grad]):
        torch.testing.assert_close(a, p.grad)
    assert model.set_checkpointing(1).checkpoint_mask == [True, False]  # a count: the first n blocks
    assert model.set_checkpointing("none").num_checkpointed_blocks == 0


def _output_and_grads(model, x, t, y):
    model.zero_grad()
    out = model(x, t, y)
    out.square().mean().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("backend", ["explicit", "math", "flash", "sdpa"])
def test_attention_backends_agree_in_fp32(backend):
    torch.manual_seed(0)
    model = randomize(tiny(class_dropout_prob=0.0))
    x, t, y = torch.randn(3, 4, 8, 8), torch.tensor([1, 500, 900]), torch.tensor([1, 2, 3])
    ref = _output_and_grads(model.set_attention("math"), x, t, y)
    got = _output_and_grads(model.set_attention(backend), x, t, y)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_explicit_attention_in_bf16_is_as_close_to_fp32_as_sdpa():
    torch.manual_seed(0)
    model = randomize(tiny(class_dropout_prob=0.0))
    x, t, y = torch.randn(4, 4, 8, 8), torch.tensor([1, 300, 600, 900]), torch.tensor([0, 1, 2, 3])
    ref = _output_and_grads(model.set_attention("math"), x, t, y)
    errors = {}
    for backend in ("explicit", "sdpa"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = _output_and_grads(model.set_attention(backend), x, t, y)
        errors[backend] = max(((b.float() - a).norm() / a.norm()).item() for a, b in zip(ref, got))
    assert errors["explicit"] < 2e-2 and errors["explicit"] < 2 * errors["sdpa"], errors


def test_auto_attention_is_explicit_only_for_bf16_on_cpu():
    assert attention_kernel("auto", "cpu", torch.bfloat16) == "explicit"
    assert attention_kernel("auto", "cpu", torch.float32) == "sdpa"
    assert attention_kernel("auto", "cuda", torch.bfloat16) == "sdpa"
    assert attention_kernel("cudnn", "cpu", torch.float32) == "cudnn"
    assert set(ATTENTION_BACKENDS) >= {"auto", "sdpa", "flash", "efficient", "cudnn", "math", "explicit"}
    with pytest.raises(UserError, match="unknown attention backend 'fast'.*explicit"):
        tiny().set_attention("fast")


def test_residual_stream_is_token_major():
    """A channel-major stream made every LayerNorm and Linear copy its input (about 4% of a CPU step)."""
    model = tiny()
    tokens = model.x_embedder(torch.randn(2, 4, 8, 8))
    assert tokens.shape == (2, 16, 32) and tokens.is_contiguous()
    assert model.blocks[0](tokens + model.pos_embed, torch.randn(2, 32)).is_contiguous()


def test_unknown_model_lists_valid_names():
    with pytest.raises(UserError, match="DiT-XL/2.*DiT-S/8"):
        model_config("DiT-M/2")


def test_bad_sizes_and_channels_name_the_problem():
    with pytest.raises(UserError, match="not divisible by patch size 4"):
        model_config("DiT-S/4", input_size=30)
    model = tiny()
    # wrong input shapes are bugs, not user mistakes: a ValueError that keeps its traceback
    with pytest.raises(ValueError, match="expects input") as err:
        model(torch.randn(1, 3, 8, 8), torch.tensor([1]), torch.tensor([1]))
    assert not isinstance(err.value, UserError)
    with pytest.raises(ValueError, match="built for 8x8"):
        model(torch.randn(1, 4, 16, 16), torch.tensor([1]), torch.tensor([1]))


def test_load_weights_names_differing_keys():
    src = tiny().state_dict()
    src.pop("final_layer.linear.bias")
    src["extra.weight"] = torch.zeros(1)
    src["pos_embed"] = torch.zeros(1, 4, 32)
    with pytest.raises(UserError) as err:
        tiny().load_weights(src, source="ckpt.pt")
    msg = str(err.value)
    assert "final_layer.linear.bias" in msg and "extra.weight" in msg and "pos_embed: (1, 4, 32)" in msg
    good = {f"module.{k}": v for k, v in tiny().state_dict().items()}
    tiny().load_weights(good)  # DDP prefixes are accepted


# ---- block options (DiTConfig.norm, mlp, rope, qk_norm) ---------------------------------------------------

ALL_OPTIONS = dict(norm="rmsnorm", mlp="swiglu", rope=True, qk_norm=True)
OPTIONS = {"rmsnorm": dict(norm="rmsnorm"), "swiglu": dict(mlp="swiglu"), "rope": dict(rope=True),
           "qk_norm": dict(qk_norm=True), "all": ALL_OPTIONS}  # fmt: skip
OFFICIAL_MODULES = {"DiT", "PatchEmbed", "Conv2d", "TimestepEmbedder", "Sequential", "Linear", "SiLU", "LabelEmbedder",
                    "Embedding", "ModuleList", "DiTBlock", "LayerNorm", "Attention", "Mlp", "FinalLayer"}  # fmt: skip


def test_options_off_build_the_official_module_tree():
    """All off, nothing is added: no module kinds, no buffers, the keys of the official release (above)."""
    with torch.device("meta"):
        model = DiT_models["DiT-XL/2"](norm="layernorm", mlp="gelu", rope=False, qk_norm=False)
    assert {type(m).__name__ for m in model.modules()} == OFFICIAL_MODULES
    assert list(model.buffers()) == [] and model.config == model_config("DiT-XL/2")
    assert all(
        not m.elementwise_affine and m.eps == 1e-6 for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
    )


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_each_option_changes_only_its_keys(options):
    base = tiny().state_dict()
    model = tiny(**options)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = {k: tuple(v.shape) for k, v in base.items()}
    d, heads = 32, 4
    if options.get("mlp") == "swiglu":  # GELU 4 x 32 = 128 wide; SwiGLU 2/3 of it, to a multiple of 8: 88
        for i in range(2):
            for old in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
                del want[f"blocks.{i}.mlp.{old}"]
            want.update({f"blocks.{i}.mlp.w12.weight": (176, d), f"blocks.{i}.mlp.w12.bias": (176,),
                         f"blocks.{i}.mlp.w3.weight": (d, 88), f"blocks.{i}.mlp.w3.bias": (d,)})  # fmt: skip
    if options.get("qk_norm"):
        want.update({f"blocks.{i}.attn.{q}_norm.weight": (d // heads,) for i in range(2) for q in "qk"})
    assert got == want
    assert {n for n, _ in model.named_buffers()} == ({"rope_cos", "rope_sin"} if options.get("rope") else set())
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
    kind = torch.nn.RMSNorm if options.get("norm") == "rmsnorm" else torch.nn.LayerNorm
    assert len(norms) == 5 and all(isinstance(m, kind) and m.weight is None for m in norms)
    assert describe(model.config).endswith(", 10 classes" + "".join(f", {o}" for o in model.config.block_options))


def test_rmsnorm_divides_by_the_root_mean_square():
    x = torch.randn(2, 5, 32) * 3 + 1
    want = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(tiny(norm="rmsnorm").blocks[0].norm1(x), want)


def test_swiglu_is_silu_gate_times_value_with_the_gelu_weights():
    model = randomize(tiny(mlp="swiglu"))
    mlp, x = model.blocks[0].mlp, torch.randn(3, 16, 32)
    w, b = mlp.w12.weight, mlp.w12.bias
    gate, value = x @ w[:88].T + b[:88], x @ w[88:].T + b[88:]
    want = (gate * torch.sigmoid(gate) * value) @ mlp.w3.weight.T + mlp.w3.bias
    torch.testing.assert_close(mlp(x), want)
    for name in ("DiT-S/2", "DiT-B/2", "DiT-L/2", "DiT-XL/2"):  # 3 D h against the GELU MLP's 2 D 4D
        cfg = model_config(name, mlp="swiglu")
        d, h = cfg.hidden_size, cfg.mlp_hidden
        assert h % 8 == 0 and abs(3 * d * h / (8 * d * d) - 1) < 1e-3
        assert (3 * d * h == 8 * d * d) == (name != "DiT-L/2")  # L: 8 x 1024 / 3 = 2730.7 -> 2728


def test_rope_tables_follow_the_formula():
    dh, grid = 16, 3
    cos, sin = rope_2d(dh, grid)
    for token in range(grid * grid):
        row, col = divmod(token, grid)
        for j in range(dh):
            axis, i = divmod(j, dh // 2)  # first half: the column, second: the row
            angle = (col, row)[axis] * 10000 ** -((i % (dh // 4)) / (dh // 4))
            assert cos[token, j] == pytest.approx(math.cos(angle), abs=1e-12)
            assert sin[token, j] == pytest.approx(math.sin(angle), abs=1e-12)


def test_rope_scores_depend_on_relative_position_only():
    """RoPE's point: q_m . k_n after rotation is a function of (row, column) offsets m - n."""
    dh, grid = 16, 6
    cos, sin = (torch.from_numpy(t).unsqueeze(1) for t in rope_2d(dh, grid))  # (tokens, 1, dh)
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, dh, generator=g, dtype=torch.float64),
        torch.randn(1, dh, generator=g, dtype=torch.float64),
    )
    rq = apply_rope(q.expand(grid * grid, 1, dh), cos.double(), sin.double())[:, 0]
    rk = apply_rope(k.expand(grid * grid, 1, dh), cos.double(), sin.double())[:, 0]

    def score(a, b):  # tokens at (row, col) a and b
        return (rq[a[0] * grid + a[1]] * rk[b[0] * grid + b[1]]).sum().item()

    assert score((1, 2), (0, 4)) == pytest.approx(score((4, 3), (3, 5)), abs=1e-12)
    assert score((0, 0), (2, 1)) == pytest.approx(score((3, 4), (5, 5)), abs=1e-12)
    assert score((1, 2), (0, 4)) != pytest.approx(score((1, 2), (0, 3)), abs=1e-6)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(grid * grid))  # a rotation


def test_qk_norm_is_a_per_head_rmsnorm_with_a_learned_weight():
    norm = HeadRMSNorm(8)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    want = torch.nn.functional.rms_norm(x, (8,), norm.weight.double(), 1e-6)
    torch.testing.assert_close(norm(x), want)
    weight = norm.weight.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: _RMSNormWeighted.apply(a, w, 1e-6), (x, weight))
    half = norm(x.detach().bfloat16())  # 16-bit in, 16-bit out, float32 inside
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", ["explicit", "math", "flash", "sdpa"])
def test_options_agree_across_attention_backends(backend):
    torch.manual_seed(0)
    model = randomize(tiny(class_dropout_prob=0.0, **ALL_OPTIONS))
    x, t, y = torch.randn(3, 4, 8, 8), torch.tensor([1, 500, 900]), torch.tensor([1, 2, 3])
    ref = _output_and_grads(model.set_attention("math"), x, t, y)
    got = _output_and_grads(model.set_attention(backend), x, t, y)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = _output_and_grads(model, x, t, y)
    assert max(((b.float() - a).norm() / a.norm()).item() for a, b in zip(ref, half)) < 3e-2


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_options_change_the_output_and_keep_checkpointing_and_cfg(options):
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 900]), torch.tensor([1, 10])
    torch.manual_seed(0)
    base = randomize(tiny()).eval()  # eval: no label dropout, so every call sees the same labels
    torch.manual_seed(0)
    model = randomize(tiny(**options)).eval()
    if set(model.state_dict()) == set(base.state_dict()):  # the same weights, another function
        model.load_state_dict(base.state_dict())
        assert not torch.allclose(model(x, t, y), base(x, t, y), atol=1e-4)
    ref = _output_and_grads(model, x, t, y)
    got = _output_and_grads(model.set_checkpointing("all"), x, t, y)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a)
    guided = model.forward_with_cfg(torch.cat([x[:1], x[:1]]), t, y, cfg_scale=4.0)
    assert guided.shape == (2, 8, 8, 8) and torch.isfinite(guided).all()


@pytest.mark.slow
def test_compiled_blocks_with_every_option_match_eager():
    torch.manual_seed(0)
    eager = randomize(tiny(class_dropout_prob=0.0, **ALL_OPTIONS))
    compiled = parallelize(randomize(tiny(class_dropout_prob=0.0, **ALL_OPTIONS)), 1, True, False, None)
    x, t, y = torch.randn(3, 4, 8, 8), torch.tensor([1, 500, 900]), torch.tensor([1, 2, 3])
    for a, b in zip(_output_and_grads(eager, x, t, y), _output_and_grads(compiled, x, t, y)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_option_values_are_checked_and_old_configs_build():
    with pytest.raises(UserError, match="unknown norm 'batchnorm'.*layernorm, rmsnorm"):
        model_config("DiT-S/2", norm="batchnorm")
    with pytest.raises(UserError, match="unknown mlp 'relu'.*gelu, swiglu"):
        model_config("DiT-S/2", mlp="relu")
    with pytest.raises(UserError, match="rope must be true or false"):
        model_config("DiT-S/2", rope="yes")
    with pytest.raises(UserError, match="head size divisible by 4.*= 6"):
        DiTConfig(hidden_size=36, num_heads=6, rope=True)
    saved = {k: v for k, v in model_config("DiT-B/4").to_dict().items() if k not in ALL_OPTIONS}  # before them
    assert DiTConfig(**saved) == model_config("DiT-B/4") and not DiTConfig(**saved).block_options


def test_a_pinned_attention_kernel_is_entered_once_around_the_blocks(monkeypatch):
    """Not inside a block: an sdpa_kernel context in a compiled block defeats AOTAutograd's cache (pytorch
    194007). In eager, a checkpointed block's recomputation re-enters the pin, and matches."""
    import dit.model.layers

    entered = []
    real = dit.model.layers.sdpa_kernel

    def spy(backends):
        entered.append(backends)
        return real(backends)

    monkeypatch.setattr(dit.model.layers, "sdpa_kernel", spy)
    torch.manual_seed(0)
    model = randomize(tiny(class_dropout_prob=0.0)).set_attention("math")
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([1, 900]), torch.tensor([1, 2])
    ref = _output_and_grads(model, x, t, y)
    assert len(entered) == 1 < len(model.blocks)
    entered.clear()
    got = _output_and_grads(model.set_checkpointing("all"), x, t, y)
    assert len(entered) == 1 + 2 * len(model.blocks)  # forward, then each block's two recompute contexts
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a)
    entered.clear()
    _output_and_grads(model.set_attention("sdpa"), x, t, y)
    assert entered == []
