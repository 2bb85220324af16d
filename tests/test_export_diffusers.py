"""scripts/export_diffusers.py: a DiTPipeline folder that diffusers loads offline, and how far it is from ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import DiTPipeline
from helpers import face, run_face, tiny_dit, write_our_checkpoint

from dit.data.vae import decode
from dit.io.cli import run_cli
from dit.io.errors import UserError
from dit.objectives.gaussian import create_diffusion
from dit.sample.export import (
    PIPELINE_NULL_CLASS,
    exported_label_table,
    timestep_embedding_gap,
    to_diffusers_transformer,
    transformer_difference,
    use_dit_timestep_frequencies,
)
from dit.sample.generate import Guidance, GuidedModel
from dit.sample.loading import load_sampling_model


@pytest.fixture(scope="module")
def exported(our_ckpt, tmp_path_factory) -> dict:  # noqa: F811
    out = tmp_path_factory.mktemp("export") / "pipe"
    labels = tmp_path_factory.mktemp("labels") / "classes.txt"
    labels.write_text("\n".join(f"class {i}, alias {i}" for i in range(10)))
    argv = ["--ckpt", str(our_ckpt), "--out", str(out), "--class-names", str(labels)]
    assert run_cli(face("scripts/export_diffusers.py").main, argv) == 0
    return {"dir": out}


def pipeline(path):
    return DiTPipeline.from_pretrained(path)


def test_exported_folder_is_a_complete_pipeline(exported):
    d = exported["dir"]
    index = json.loads((d / "model_index.json").read_text())
    assert index["_class_name"] == "DiTPipeline"
    assert {"transformer", "vae", "scheduler"} <= set(index) and index["id2label"]["3"] == "class 3, alias 3"
    config = json.loads((d / "transformer" / "config.json").read_text())
    assert config["norm_eps"] == 1e-6 and config["num_embeds_ada_norm"] == PIPELINE_NULL_CLASS
    assert json.loads((d / "scheduler" / "scheduler_config.json").read_text())["_class_name"] == "DDIMScheduler"
    readme = (d / "README.md").read_text()  # how to load it with DiT's exact timestep frequencies
    assert "downscale_freq_shift = 0" in readme and "from_pretrained" in readme


OFFLINE_USE = """
import json, sys, numpy as np, torch
from diffusers import DiTPipeline
pipe = DiTPipeline.from_pretrained(sys.argv[1])
result = {"ids": pipe.get_label_ids(["class 4", "alias 7"])}
for guidance in (1.0, 4.0):  # > 1 guides against class 1000, where the export put our null class
    images = pipe(class_labels=[1, 2], num_inference_steps=5, guidance_scale=guidance,
                  generator=torch.Generator().manual_seed(0), output_type="np").images
    result[str(guidance)] = [list(images.shape), bool(np.isfinite(images).all()), float(images.min()), float(images.max())]
print(json.dumps(result))
"""


def test_pipeline_loads_offline_and_generates(exported):
    """In a fresh process with the hub switched off and any network access sent to a dead proxy."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
    }
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", OFFLINE_USE, str(exported["dir"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ids"] == [4, 7]
    for guidance in ("1.0", "4.0"):
        shape, finite, lo, hi = result[guidance]
        assert shape == [2, 64, 64, 3] and finite and 0 <= lo <= hi <= 1


def test_transformer_difference_is_the_timestep_convention_only(our_ckpt, exported, capsys):  # noqa: F811
    sm = load_sampling_model(our_ckpt)
    transformer = pipeline(exported["dir"]).transformer
    as_exported = transformer_difference(sm.model, transformer, batch=16)
    patched = transformer_difference(sm.model, use_dit_timestep_frequencies(transformer), batch=16)
    gap = timestep_embedding_gap()
    with capsys.disabled():
        print(
            f"\n[export] transformer vs ours (random weights, std 0.1): max |diff| {as_exported['max_abs']:.3g}, "
            f"relative RMS {as_exported['relative_rms']:.3g}; DiT frequencies patched in: max |diff| "
            f"{patched['max_abs']:.3g}; timestep features differ by {gap['relative_l2_mean']:.1%} on average "
            f"(t=999: {gap['relative_l2_at_tmax']:.1%})"
        )
    assert patched["max_abs"] < 1e-5 * max(1.0, patched["output_rms"]), "the mapping itself must be exact"
    assert 0 < as_exported["relative_rms"] < 0.5
    assert gap["relative_l2_at_t0"] == 0 and gap["relative_l2_at_tmax"] > 0.5


def test_pipeline_matches_our_ddim_sampler_end_to_end(our_ckpt, exported):  # noqa: F811
    """With DiT's frequencies patched in, DiTPipeline (DDIM, guidance on all channels, null class 1000) makes
    our images: so the scheduler, the guidance and the label-table move are right, not just the weights."""
    sm = load_sampling_model(our_ckpt)
    pipe = pipeline(exported["dir"])
    kwargs = dict(class_labels=[1, 2], num_inference_steps=5, guidance_scale=4.0, output_type="np")
    theirs_as_exported = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    use_dit_timestep_frequencies(pipe.transformer)
    theirs = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images

    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))  # what the pipeline draws
    y = torch.tensor([1, 2])
    model_fn = GuidedModel(sm.model, Guidance(4.0, "all"), None, None)
    latents = create_diffusion("ddim5").ddim_sample_loop(
        model_fn, x.shape, x, clip_denoised=False, model_kwargs={"y": y}
    )
    ours = ((decode(sm.vae, latents) + 1) / 2).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    assert np.abs(theirs_as_exported - ours).max() > 1e-3, "unpatched, the timestep convention shows"


def test_label_table_moves_the_null_class_to_1000():
    model = tiny_dit()
    table = model.y_embedder.embedding_table.weight
    out = exported_label_table(table, model.config)
    assert out.shape == (PIPELINE_NULL_CLASS + 1, table.shape[1])
    assert torch.equal(out[:10], table[:10]) and torch.equal(out[PIPELINE_NULL_CLASS], table[10])
    assert torch.equal(out[500], table[10]), "unused ids act as the unconditional class"
    no_null = tiny_dit(class_dropout_prob=0.0)
    assert exported_label_table(no_null.y_embedder.embedding_table.weight, no_null.config)[1000].abs().sum() == 0


def test_export_refuses_bad_targets(our_ckpt, exported, tmp_path, capsys):  # noqa: F811
    code, _, err = run_face(
        "scripts/export_diffusers.py", ["--ckpt", str(our_ckpt), "--out", str(exported["dir"])], capsys
    )
    assert code == 2 and "already exists and is not empty" in err
    pixel = write_our_checkpoint(tmp_path / "pixel", None, in_channels=3, input_size=16)
    code, _, err = run_face(
        "scripts/export_diffusers.py", ["--ckpt", str(pixel), "--out", str(tmp_path / "p")], capsys
    )
    assert code == 2 and "pixel-space model cannot be exported" in err and not (tmp_path / "p").exists()
    with pytest.raises(UserError, match="4x MLP"):
        to_diffusers_transformer(tiny_dit(mlp_ratio=2.0))
    with pytest.raises(UserError, match="block options.*swiglu, qk-norm"):
        to_diffusers_transformer(tiny_dit(mlp="swiglu", qk_norm=True))
