"""Token dropping (SPRINT's dense -> sparse -> dense layout, MaskDiT's masking): the model at R = 0 is today's,
the FLOP counts agree with the real model at every R, the kept set is keyed by (seed, step), positions follow
the kept tokens, the stages and path-drop guidance are priced, and bad input is one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dit.cost.__main__ import main as cost_main
from dit.cost.analytic import forward_macs, param_counts, sampling_flops_per_image, training_flops_per_image
from dit.cost.measured import measure_flops
from dit.cost.memory import estimate_training_memory
from dit.io.errors import UserError
from dit.model.config import model_config
from dit.model.dit import DiT
from dit.model.tokendrop import gather_tokens, kept_rope
from dit.train.tokendrop import TokenDropSection, kept_tokens

OFFICIAL_KEYS = Path(__file__).parent / "data" / "official_dit_xl2_state_dict.txt"


def small(**kw):
    return model_config("DiT-S/2", input_size=16, num_classes=10, **kw)


def inputs(cfg, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.in_channels, cfg.input_size, cfg.input_size, generator=g)
    return x, torch.randint(0, 1000, (n,), generator=g), torch.randint(0, cfg.num_classes, (n,), generator=g)


def randomised(cfg, seed=0):
    """A model with every weight random (the zero-initialised output layers too), so outputs mean something."""
    torch.manual_seed(seed)
    model = DiT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    return model


def test_zero_drop_is_todays_model():
    """R = 0: the official XL/2 keys, strict loads both ways, and the forward of the plain block loop bit for bit."""
    with torch.device("meta"):
        keys = list(DiT(model_config("DiT-XL/2", token_drop=0.0)).state_dict())
    official = [line.split()[0] for line in OFFICIAL_KEYS.read_text().splitlines() if line.strip()]
    assert keys == official
    cfg = small(rope=True)
    model = randomised(cfg)
    x, t, y = inputs(cfg)
    c = model.t_embedder(t) + model.y_embedder(y, False)
    h = model.x_embedder(x) + model.pos_embed
    rope = (model.rope_cos, model.rope_sin)
    for block in model.blocks:
        h = block(h, c, rope)
    with torch.no_grad():
        assert torch.equal(model(x, t, y), model.unpatchify(model.final_layer(h, c)))
    DiT(small(rope=True)).load_weights(model.state_dict())


@pytest.mark.parametrize("layout", ["sprint", "maskdit"])
def test_the_drop_parameters_exist_only_when_dropping(layout):
    plain = set(DiT(small()).state_dict())
    dropping = DiT(small(token_drop=0.5, token_drop_layout=layout))
    extra = set(dropping.state_dict()) - plain
    expected = {"token_drop.mask_token"} | (
        {"token_drop.fuse.weight", "token_drop.fuse.bias"} if layout == "sprint" else set()
    )
    assert extra == expected and plain <= set(dropping.state_dict())
    assert param_counts(dropping.config).total == sum(p.numel() for p in dropping.parameters())
    with pytest.raises(UserError, match="unexpected"):
        DiT(small()).load_weights(dropping.state_dict())


@pytest.mark.parametrize("layout", ["sprint", "maskdit"])
@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.75])
@pytest.mark.parametrize("patch", [1, 2])
def test_analytic_flops_equal_the_meta_device_count(layout, ratio, patch):
    cfg = model_config("DiT-S/2", input_size=8, patch_size=patch, num_classes=10, token_drop=ratio,
                       token_drop_layout=layout)  # fmt: skip
    measured = measure_flops(cfg, batch_size=2, checkpointed_blocks=3)
    analytic = forward_macs(cfg)
    assert measured["forward_flops_per_image"] == analytic.flops
    for name, flops in measured["forward_components"].items():
        assert flops == 2 * (analytic.attention if name == "attention" else analytic.components[name]), name
    skipped = 2 * (analytic.components["patch_embed"] + cfg.frequency_embedding_size * cfg.hidden_size)
    train = training_flops_per_image(cfg, checkpointed_blocks=3, fused_attention=False)
    assert measured["train_flops_per_image"] == train.hardware - skipped
    if ratio:  # fewer FLOPs than at full tokens, which the second stage counts
        assert train.model < training_flops_per_image(cfg, 3, False, ratio=0).model
        assert measure_flops(cfg, 2, train=False, ratio=0)["forward_flops_per_image"] == forward_macs(cfg, 0).flops


def test_half_the_tokens_cost_at_least_1_6x_fewer_flops_on_xl2():
    base, dropped = model_config("DiT-XL/2"), model_config("DiT-XL/2", token_drop=0.5)
    assert training_flops_per_image(base).model / training_flops_per_image(dropped).model >= 1.6
    assert estimate_training_memory(dropped, 32, "bf16").total < estimate_training_memory(base, 32, "bf16").total


def test_path_drop_guidance_skips_the_sparse_blocks_and_costs_less():
    cfg = small(token_drop=0.75)
    full, dropped = forward_macs(cfg, 0), forward_macs(cfg, 0, path_drop=True)
    cfg_cost = sampling_flops_per_image(cfg, 10, 4.0).model
    pdg_cost = sampling_flops_per_image(cfg, 10, 4.0, path_drop=True).model
    assert cfg_cost == 20 * full.flops and pdg_cost == 10 * (full.flops + dropped.flops) < cfg_cost
    model = randomised(cfg)
    x, t, y = inputs(cfg, 2)
    both = torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, 10)])
    with torch.no_grad():
        guided = model.forward_with_cfg(*both, 4.0, path_drop=True)
        uncond = model(x, t, both[2][2:], path_drop=True)
        cond = model(x, t, y)
    assert torch.allclose(guided[:2, :3], uncond[:, :3] + 4.0 * (cond[:, :3] - uncond[:, :3]), atol=1e-6)
    with pytest.raises(UserError, match="--guidance-path-drop"):
        sampling_flops_per_image(small(), 10, 4.0, path_drop=True)


@pytest.mark.parametrize("layout", ["sprint", "maskdit"])
def test_kept_tokens_keep_their_positions(layout):
    """Every token kept = the full-token path; the same kept set in another order gives the same output, which
    only holds if the RoPE angles and the sin-cos table travel with their tokens."""
    cfg = small(token_drop=0.5, token_drop_layout=layout, rope=True)
    model = randomised(cfg)
    x, t, y = inputs(cfg, 2)
    every = torch.arange(cfg.tokens).expand(2, -1)
    kept = kept_tokens(cfg, seed=0, step=0, batch=2, device="cpu")
    with torch.no_grad():
        assert torch.allclose(model(x, t, y, kept=every), model(x, t, y), atol=1e-5)
        assert torch.allclose(model(x, t, y, kept=kept), model(x, t, y, kept=kept.flip(1)), atol=1e-5)
        assert not torch.allclose(model(x, t, y, kept=kept), model(x, t, y), atol=1e-3)
    cos, _ = kept_rope((model.rope_cos, model.rope_sin), kept)
    assert torch.equal(cos[1, 5], model.rope_cos[kept[1, 5]])
    assert torch.equal(
        gather_tokens(model.pos_embed.expand(2, -1, -1), kept)[1, 5], model.pos_embed[0, kept[1, 5]]
    )


def test_the_kept_set_is_keyed_by_seed_and_step_and_split_by_rank():
    cfg = small(token_drop=0.75)
    whole = kept_tokens(cfg, seed=3, step=7, batch=8, device="cpu")
    assert whole.shape == (8, cfg.kept_tokens()) == (8, 16)
    assert all(len(set(row.tolist())) == 16 for row in whole)
    assert torch.equal(whole, kept_tokens(cfg, seed=3, step=7, batch=8, device="cpu"))  # a resume draws it again
    ranks = [kept_tokens(cfg, 3, 7, 8, "cpu")[r * 4 : (r + 1) * 4] for r in range(2)]  # world 2: each its rows
    assert torch.equal(torch.cat(ranks), whole)
    assert not torch.equal(whole, kept_tokens(cfg, seed=3, step=8, batch=8, device="cpu"))
    assert not torch.equal(whole, kept_tokens(cfg, seed=4, step=7, batch=8, device="cpu"))


def test_the_second_stage_ends_dropping():
    cfg = small(token_drop=0.5)
    stages = TokenDropSection(token_drop_until=3)
    assert [stages.dropping(cfg, s) for s in range(5)] == [True, True, True, False, False]
    assert stages.dropped_steps(cfg, 10) == 3 and TokenDropSection().dropped_steps(cfg, 10) == 10
    assert not TokenDropSection().dropping(small(), 0)


def test_training_drops_resumes_bit_exact_and_counts_each_stage(tmp_path):
    """Two steps dropping then two at full tokens: a resume between them trains the same weights, and the run's
    FLOPs are each stage's own."""
    from test_train import Pixels, tiny_config, weights

    from dit.checkpoint import latest_checkpoint
    from dit.train.trainer import train

    kw = dict(depth=5, token_drop=0.5, token_drop_until=2, log_every=1, mfu_warmup_steps=0)
    train(tiny_config(tmp_path / "a", max_steps=4, **kw), Pixels())
    train(tiny_config(tmp_path / "b", max_steps=3, **kw), Pixels())
    train(tiny_config(tmp_path / "b", max_steps=4, resume="auto", **kw), Pixels())
    a, b = (weights(latest_checkpoint(tmp_path / r / "run" / "checkpoints"))[0] for r in "ab")
    assert a.keys() == b.keys() and "token_drop.fuse.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()]
    totals = [r["total_model_pflops"] * 1e15 for r in rows if r.get("kind") == "train"]
    cfg = model_config("DiT-S/2", depth=5, hidden_size=32, num_heads=2, input_size=8, in_channels=3, num_classes=4,
                       learn_sigma=True, token_drop=0.5)  # fmt: skip
    dropping, full = (8 * training_flops_per_image(cfg, ratio=r).model for r in (None, 0))
    assert totals == pytest.approx([dropping, 2 * dropping, 2 * dropping + full, 2 * dropping + 2 * full])


def test_a_resume_may_change_the_ratio_only_when_allowed(tmp_path):
    from test_train import Pixels, tiny_config

    from dit.train.trainer import train

    train(tiny_config(tmp_path, max_steps=1, depth=5, token_drop=0.5), Pixels())
    with pytest.raises(UserError, match="token-drop 0.5"):
        train(tiny_config(tmp_path, max_steps=2, depth=5, token_drop=0.75, resume="auto"), Pixels())
    with pytest.raises(UserError, match="token_drop_until"):
        train(tiny_config(tmp_path, max_steps=2, depth=5, token_drop=0.5, token_drop_until=1, resume="auto"),
              Pixels())  # fmt: skip
    allowed = ["token_drop", "token_drop_until"]
    cfg = tiny_config(tmp_path, max_steps=2, depth=5, token_drop=0.75, token_drop_until=1, resume="auto",
                      allow_changes=allowed)  # fmt: skip
    assert train(cfg, Pixels())["step"] == 2


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["flops", "--token-drop", "1"], "--token-drop must be < 1"),
        (["flops", "--token-drop", "-0.1"], "--token-drop must be >= 0"),
        (["train", "--model", "DiT-S/2", "--depth", "4", "--token-drop", "0.5"], "depth of at least 5"),
        (
            [
                "memory",
                "--model",
                "DiT-S/2",
                "--depth",
                "2",
                "--token-drop",
                "0.5",
                "--token-drop-layout",
                "maskdit",
                "--batch-per-device",
                "2",
            ],
            "depth of at least 3",
        ),  # fmt: skip
        (["sample", "--model", "DiT-S/2", "--guidance-path-drop"], "--guidance-path-drop"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, needle):
    code = cost_main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_bad_training_input_is_one_line(tmp_path):
    from test_train import tiny_config

    with pytest.raises(UserError, match="--token-drop-until ends token dropping"):
        tiny_config(tmp_path, depth=5, token_drop_until=3)
    with pytest.raises(UserError, match="--token-drop needs a depth of at least 5"):
        tiny_config(tmp_path, token_drop=0.5)
    with pytest.raises(UserError, match="--token-drop must be < 1"):
        tiny_config(tmp_path, depth=5, token_drop=1.0)


def test_the_faces_show_the_options(capsys):
    for command in ("train", "flops", "memory"):
        with pytest.raises(SystemExit):
            cost_main([command, "--help"])
        assert "--token-drop" in capsys.readouterr().out
    repo = Path(__file__).resolve().parents[1]
    text = subprocess.run([sys.executable, "train.py", "--help"], cwd=repo, capture_output=True, text=True).stdout
    assert all(f in text for f in ("--token-drop ", "--token-drop-until", "--token-drop-layout", "path-drop"))


def test_the_benchmark_times_the_ratios_in_turns(tmp_path):
    rows_file = tmp_path / "rows.json"
    args = ["train", "--model", "DiT-S/2", "--image-size", "64", "--global-batch-size", "2", "--timed-steps", "2",
            "--untimed-steps", "1", "--peak-tflops", "1000", "--peak-probe", "0", "--token-drop", "0", "0.5",
            "--out", str(rows_file)]  # fmt: skip
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "scripts/benchmark.py", *args], cwd=repo, capture_output=True, text=True,
                         timeout=1800)  # fmt: skip
    assert out.returncode == 0, out.stderr
    full, dropped = sorted(json.loads(rows_file.read_text())["rows"], key=lambda r: r["token_drop"])
    assert (full["token_drop"], dropped["token_drop"]) == (0.0, 0.5)
    assert dropped["speedup_vs_no_drop"] == pytest.approx(full["median_s"] / dropped["median_s"])
    assert dropped["model_tflops"] / dropped["images_per_sec"] < full["model_tflops"] / full["images_per_sec"]
