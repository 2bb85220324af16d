"""Export a DiT checkpoint as a diffusers ``DiTPipeline`` folder, and say how far it is from ours.

python scripts/export_diffusers.py --ckpt results/.../0400000.pt --out DiT-export
python -c "from diffusers import DiTPipeline; DiTPipeline.from_pretrained('DiT-export')"
"""

from __future__ import annotations

from dataclasses import dataclass

from dit.io.cli import run_cli
from dit.io.config import Section, option
from dit.io.face import Face
from dit.sample.export import export_checkpoint, timestep_embedding_gap
from dit.sample.loading import WeightsSection


@dataclass(frozen=True)
class ExportConfig(Section):
    out: str = option(help="folder to create (must not exist or be empty)")
    class_names: str | None = option(
        None, "class names: a text file with one per line, or a JSON list/object", aliases=("--labels",)
    )


FACE = Face(
    "scripts/export_diffusers.py",
    __doc__,
    sections={"weights": WeightsSection, "export": ExportConfig},
    outputs={"out": "folder"},
    inputs={"ckpt": "file", "vae": "file", "class_names": "file"},
)


def main(argv: list[str] | None = None) -> int:
    parsed = FACE.parse(argv).sections
    w, a = parsed["weights"], parsed["export"]
    r = export_checkpoint(w, a.out, a.class_names)
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
