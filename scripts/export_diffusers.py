"""Export a DiT checkpoint as a diffusers ``DiTPipeline`` folder, and say how far it is from ours.

python scripts/export_diffusers.py --ckpt results/.../0400000.pt --out DiT-export
python -c "from diffusers import DiTPipeline; DiTPipeline.from_pretrained('DiT-export')"
"""

from __future__ import annotations

import argparse

from dit.cli import run_cli
from dit.models import MODEL_NAMES
from dit.sample.export import export_checkpoint, timestep_embedding_gap


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True, help="folder to create (must not exist or be empty)")
    p.add_argument("--vae", help="VAE to ship: ema, mse, a hub id or a folder (default: as sample.py)")
    p.add_argument("--model", choices=MODEL_NAMES, help="for files without a config (default DiT-XL/2)")
    p.add_argument("--image-size", type=int, help="for files without a config (default 256)")
    p.add_argument("--num-classes", type=int, help="for files without a config (default 1000)")
    p.add_argument("--labels", help="class names: a text file with one per line, or a JSON list/object")
    p.add_argument("--no-ema", dest="ema", action="store_false")
    a = p.parse_args(argv)
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
