"""Export a DiT checkpoint as a diffusers ``DiTPipeline`` folder, and say how far it is from ours.

python scripts/export_diffusers.py --ckpt results/.../0400000.pt --out DiT-export
python -c "from diffusers import DiTPipeline; DiTPipeline.from_pretrained('DiT-export')"
"""

from __future__ import annotations

from dataclasses import dataclass

from dit.cli import run_cli
from dit.config import option, parse_config
from dit.sample.export import export_checkpoint, timestep_embedding_gap


@dataclass
class ExportConfig:
    ckpt: str = option(help="our training checkpoint, an official train.py file, or a bare state dict")
    out: str = option(help="folder to create (must not exist or be empty)")
    vae: str | None = option(None, "VAE to ship: ema, mse, a hub id or a folder (default: as sample.py)")
    model: str | None = option(None, "for files without a config (default DiT-XL/2)")
    image_size: int | None = option(None, "for files without a config (default 256)")
    num_classes: int | None = option(None, "for files without a config (default 1000)")
    labels: str | None = option(None, "class names: a text file with one per line, or a JSON list/object")
    ema: bool = option(True, "export the EMA weights (--no-ema: the raw weights)")


def main(argv: list[str] | None = None) -> int:
    a = parse_config(ExportConfig, argv, description=__doc__)
    r = export_checkpoint(a.ckpt, a.out, a.vae, a.model, a.image_size, a.num_classes, a.ema, a.labels)
    gap = timestep_embedding_gap()
    print(f"wrote DiTPipeline to {r['out']} ({r['weights']} weights, VAE {r['vae']})")
    print(
        f"transformer vs ours: max |diff| {r['as_exported']['max_abs']:.3g}, relative RMS "
        f"{r['as_exported']['relative_rms']:.3g} (diffusers' timestep frequencies; their features differ from "
        f"DiT's by {gap['relative_l2_mean']:.1%} on average over t); with DiT's frequencies patched in: "
        f"{r['with_dit_frequencies']['max_abs']:.3g}"
    )
    for note in r["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
