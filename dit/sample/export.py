"""Our DiTs out to diffusers as a ``DiTPipeline`` folder; its two differences, diffusers' timestep frequencies and
the pipeline's null class 1000, are measured (``transformer_difference``), not exported away."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import typing
from pathlib import Path

import torch

from dit.io.atomic import CannotWrite, atomic_write_bytes
from dit.io.errors import UserError, require
from dit.io.userfiles import read_json, read_text
from dit.model.config import DiTConfig
from dit.model.dit import DiT
from dit.model.layers import timestep_embedding

if typing.TYPE_CHECKING:
    from diffusers import DiTTransformer2DModel

PIPELINE_NULL_CLASS = 1000  # DiTPipeline.__call__ hard-codes the unconditional label


def diffusers_transformer_config(cfg: DiTConfig) -> dict:
    """``DiTTransformer2DModel`` arguments for a DiT, or a UserError naming what diffusers cannot express."""
    if cfg.num_classes == 0:
        raise UserError("diffusers' DiTPipeline is class-conditional; an unconditional DiT cannot be exported.")
    if cfg.mlp_ratio != 4.0 or cfg.frequency_embedding_size != 256:
        raise UserError(
            f"diffusers' DiT has a 4x MLP and 256 timestep frequencies; this model has mlp_ratio {cfg.mlp_ratio} "
            f"and {cfg.frequency_embedding_size} frequencies, so it cannot be exported."
        )
    if cfg.block_options:
        raise UserError(
            f"diffusers' DiT has none of the block options; this model has {', '.join(cfg.block_options)}, "
            "so it cannot be exported."
        )
    # norm_eps: DiT's LayerNorms' 1e-6; diffusers' default 1e-5 would change the MLP norm
    return dict(
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.hidden_size // cfg.num_heads,
        in_channels=cfg.in_channels,
        out_channels=cfg.out_channels,
        num_layers=cfg.depth,
        sample_size=cfg.input_size,
        patch_size=cfg.patch_size,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=max(cfg.num_classes, PIPELINE_NULL_CLASS),
        norm_type="ada_norm_zero",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    )


def exported_label_table(table: torch.Tensor, cfg: DiTConfig) -> torch.Tensor:
    """Our class table with the null row at 1000 (and the unused ids), where ``DiTPipeline`` looks for it."""
    rows = max(cfg.num_classes, PIPELINE_NULL_CLASS) + 1
    has_null = table.shape[0] > cfg.num_classes
    null = table[cfg.num_classes] if has_null else torch.zeros_like(table[0])
    out = null.expand(rows, -1).clone()
    out[: cfg.num_classes] = table[: cfg.num_classes]
    return out


def to_diffusers_state_dict(state_dict: dict, cfg: DiTConfig) -> dict:
    """Our (the official) keys onto diffusers': per-block embedders, qkv split, ``pos_embed`` dropped."""
    sd = {k: v.detach().float().cpu() for k, v in state_dict.items()}
    renamed = {
        "pos_embed.proj": "x_embedder.proj",
        "proj_out_1": "final_layer.adaLN_modulation.1",
        "proj_out_2": "final_layer.linear",
    }
    out = {f"{t}.{kind}": sd[f"{o}.{kind}"] for t, o in renamed.items() for kind in ("weight", "bias")}
    labels = exported_label_table(sd["y_embedder.embedding_table.weight"], cfg)
    for i in range(cfg.depth):
        ours, theirs = f"blocks.{i}.", f"transformer_blocks.{i}."
        emb = theirs + "norm1.emb."
        for n, m in (("1", "0"), ("2", "2")):
            out[f"{emb}timestep_embedder.linear_{n}.weight"] = sd[f"t_embedder.mlp.{m}.weight"].clone()
            out[f"{emb}timestep_embedder.linear_{n}.bias"] = sd[f"t_embedder.mlp.{m}.bias"].clone()
        out[f"{emb}class_embedder.embedding_table.weight"] = labels.clone()
        for kind in ("weight", "bias"):
            q, k, v = sd[f"{ours}attn.qkv.{kind}"].chunk(3, dim=0)
            out[f"{theirs}attn1.to_q.{kind}"], out[f"{theirs}attn1.to_k.{kind}"] = q.clone(), k.clone()
            out[f"{theirs}attn1.to_v.{kind}"] = v.clone()
            out[f"{theirs}norm1.linear.{kind}"] = sd[f"{ours}adaLN_modulation.1.{kind}"]
            out[f"{theirs}attn1.to_out.0.{kind}"] = sd[f"{ours}attn.proj.{kind}"]
            out[f"{theirs}ff.net.0.proj.{kind}"] = sd[f"{ours}mlp.fc1.{kind}"]
            out[f"{theirs}ff.net.2.{kind}"] = sd[f"{ours}mlp.fc2.{kind}"]
    return out


def _diffusers():
    return require("diffusers", "vae", "the diffusers export")


def to_diffusers_transformer(model: DiT) -> DiTTransformer2DModel:
    transformer = _diffusers().DiTTransformer2DModel(**diffusers_transformer_config(model.config))
    transformer.load_state_dict(to_diffusers_state_dict(model.state_dict(), model.config), strict=True)
    return transformer.eval()


def use_dit_timestep_frequencies(transformer: DiTTransformer2DModel) -> DiTTransformer2DModel:
    """Make a loaded transformer divide by half as DiT does (no config key saves it); it then matches ours."""
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
    return transformer


def timestep_embedding_gap(dim: int = 256, num_timesteps: int = 1000) -> dict:
    """How far diffusers' timestep features are from DiT's, over t = 0..T-1 (weights play no part)."""
    t = torch.arange(num_timesteps)
    ours = timestep_embedding(t, dim)
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / (half - 1))
    args = t[:, None].float() * freqs[None]
    theirs = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    diff = theirs - ours
    per_t = diff.norm(dim=1) / ours.norm(dim=1)
    return {
        "max_abs": diff.abs().max().item(),
        "relative_l2_mean": per_t.mean().item(),
        "relative_l2_at_t0": per_t[0].item(),
        "relative_l2_at_tmax": per_t[-1].item(),
    }


@torch.no_grad()
def transformer_difference(
    model: DiT, transformer: DiTTransformer2DModel, batch: int = 8, seed: int = 0
) -> dict[str, float]:
    """Max |diff| and relative RMS of the exported transformer against our model on random inputs."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, cfg.input_size, cfg.input_size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    y = torch.randint(0, max(cfg.num_classes, 1), (batch,), generator=g)
    model = model.float().cpu().eval()
    ours = model(x, t, y)
    theirs = transformer.float().cpu().eval()(x, timestep=t, class_labels=y).sample
    diff = theirs - ours
    return {
        "max_abs": diff.abs().max().item(),
        "relative_rms": (diff.norm() / ours.norm().clamp_min(1e-30)).item(),
        "output_rms": (ours.norm() / math.sqrt(ours.numel())).item(),
    }


EXPORT_README = """# A DiT exported by dit-ledger

```python
from diffusers import DiTPipeline

pipe = DiTPipeline.from_pretrained(".")  # works offline
```

**Timestep frequencies.** diffusers' DiT divides the timestep frequencies by half - 1 where DiT divides by
half, and has no config key to change it, so a pipeline loaded as above differs from the trained model (for
a trained DiT-XL/2, a relative RMS of about 1e-2 in the output). For the exact model, patch the loaded
transformer before sampling:

```python
for block in pipe.transformer.transformer_blocks:
    block.norm1.emb.time_proj.downscale_freq_shift = 0  # dit.sample.export.use_dit_timestep_frequencies
```

**Guidance.** `DiTPipeline` guides with the null class 1000 and on all latent channels; the official DiT
(and dit-ledger's sample.py by default) guides the first three. Its `guidance_scale` is therefore not the
paper's scale: for the paper's samples, use dit-ledger's `sample.py` or `scripts/sample_ddp.py`.
"""


def export_pipeline(
    model: DiT, vae, out_dir: str | os.PathLike, noise_schedule: str = "linear", id2label: dict | None = None
) -> Path:
    """Write a ``DiTPipeline`` folder, assembled in a temp folder beside ``out_dir`` and renamed into place."""
    if vae is None:
        raise UserError("DiTPipeline decodes latents with a VAE; a pixel-space model cannot be exported.")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"{out_dir} already exists and is not empty: pass a new --out or delete it.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    labels = id2label or {i: str(i) for i in range(model.config.num_classes)}
    transformer = to_diffusers_transformer(model)
    if noise_schedule not in ("linear", "squaredcos_cap_v2"):
        raise UserError(f"noise schedule {noise_schedule!r} has no diffusers equivalent: use linear.")
    # DiT's training schedule as diffusers' DDIM scheduler (as diffusers' own DiT conversion builds it)
    scheduler = _diffusers().DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=1e-4,
        beta_end=0.02,
        beta_schedule=noise_schedule,
        prediction_type="epsilon",
        clip_sample=False,
    )
    pipe = _diffusers().DiTPipeline(transformer=transformer, vae=vae, scheduler=scheduler)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        pipe.save_pretrained(tmp)
        # save_pretrained does not write id2label; DiTPipeline.__init__ reads it from model_index.json.
        index = json.loads((tmp / "model_index.json").read_text())
        index["id2label"] = {str(k): v for k, v in labels.items()}
        atomic_write_bytes(tmp / "model_index.json", json.dumps(index, indent=2).encode())
        atomic_write_bytes(tmp / "README.md", EXPORT_README.encode())
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # a full disk: the line, not the traceback; safetensors (Rust) reports one as ``... (os error 28)``
        found = re.search(r"\(os error (\d+)\)", str(e))
        if isinstance(e, OSError) or found:
            refused = e if isinstance(e, OSError) else OSError(int(found[1]), os.strerror(int(found[1])))
            raise CannotWrite(out_dir, refused) from None
        raise
    return out_dir


def read_id2label(path: str | os.PathLike) -> dict[int, str]:
    """Class names from a text file (one per line, line i = class i) or a JSON list or {id: name} object."""
    path, fix = Path(path), "pass a text file with one class name per line, or a JSON list or {id: name} object"
    if path.suffix != ".json":
        lines = read_text(path, "labels file", fix).splitlines()
        return {i: line.strip() for i, line in enumerate(lines) if line.strip()}
    data = read_json(path, "labels file", fix)
    items = enumerate(data) if isinstance(data, list) else data.items() if isinstance(data, dict) else None
    try:
        return {int(k): str(v) for k, v in items}
    except (TypeError, ValueError):  # a number, or an object whose keys are not class ids
        raise UserError(
            f"labels file {path} must hold a JSON list or an object keyed by class id: {fix}."
        ) from None


def export_checkpoint(weights, out: str, labels: str | None = None) -> dict:
    """Export a ``WeightsSection``'s checkpoint as a DiTPipeline folder and measure what the export changes."""
    from dit.sample.loading import load_weights

    sm = load_weights(weights, "cpu")
    if sm.latent_norm is not None:  # DiTPipeline divides latents by the VAE's one scaling factor
        raise UserError(
            "the checkpoint was trained with --latent-norm channel; DiTPipeline undoes only the VAE's one scaling "
            "factor, so its images would be wrong: sample it with sample.py instead. Nothing was written."
        )
    id2label = read_id2label(labels) if labels else None
    if id2label and set(id2label) != set(range(sm.config.num_classes)):
        raise UserError(
            f"{labels} names {len(id2label)} classes, the model has {sm.config.num_classes}: give one name per class."
        )
    path = export_pipeline(sm.model, sm.vae, out, sm.noise_schedule, id2label)
    transformer = _diffusers().DiTTransformer2DModel.from_pretrained(path / "transformer")
    as_exported = transformer_difference(sm.model, transformer, batch=2)
    with_dit_frequencies = transformer_difference(sm.model, use_dit_timestep_frequencies(transformer), batch=2)
    notes = []
    if sm.config.num_classes > PIPELINE_NULL_CLASS:
        notes.append("DiTPipeline guides against class 1000, a real class of this model: use guidance_scale=1.")
    if sm.config.class_dropout_prob <= 0:
        notes.append("the model has no unconditional class: use guidance_scale=1.")
    return {
        "out": path,
        "weights": sm.weights,
        "vae": sm.vae_spec,
        "as_exported": as_exported,
        "with_dit_frequencies": with_dit_frequencies,
        "notes": notes,
    }
