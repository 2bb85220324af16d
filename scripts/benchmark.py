"""Benchmarks: training-step and sampling throughput, accounting overhead, latent-store reader speed.

  python scripts/benchmark.py train --model DiT-S/2 DiT-B/2 --global-batch-size 8 --precision fp32 bf16
  python scripts/benchmark.py train --model DiT-XL/2 --global-batch-size 64 --precision bf16 --compile on \\
      --calibration calib.json          # then: dit-cost train ... --calibration calib.json
  python scripts/benchmark.py sample --model DiT-XL/2 --num-sampling-steps 50 --guidance-scale 4
  python scripts/benchmark.py accounting --model DiT-S/2
  python scripts/benchmark.py reader [--store STORE]   # default: a synthetic 10,000-image 4x32x32 store
  python scripts/benchmark.py loss --max-steps 400 --plot curves.png   # bf16 vs fp32 training curves
  python scripts/benchmark.py profile --model DiT-S/2 --precision fp32     # one step's op table
  python scripts/benchmark.py attention --model DiT-B/2 --precision bf16   # attention kernels, one block
  python scripts/benchmark.py repeat --repeats 3                              # MFU over repeated runs

Each run prints a table and, with --out FILE, writes every row (the machine's measured matmul peaks too); train
and sample rewrite FILE as each row finishes ("complete": false until the run ends). On CUDA, train skips a
configuration that dit-cost's memory estimate says does not fit the device (the reason is in its row)."""

from __future__ import annotations

import json
import sys

from dit import bench
from dit.io.atomic import atomic_write_bytes
from dit.io.cli import exit_process, run_cli
from dit.io.face import Face
from dit.runtime import Runtime

FACE = Face(
    "scripts/benchmark.py",
    __doc__,
    commands={name: Face(f"scripts/benchmark.py {name}", help_text, sections={"bench": cls},
                         outputs={k: "file" for k in ("out", "plot", "calibration") if k in cls.names()},
                         inputs={"store": "folder"} if "store" in cls.names() else None)
              for name, (cls, help_text) in bench.MODES.items()},
)  # fmt: skip


def _table(rows: list[dict], keys: list[str]) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def main(argv=None) -> int:
    parsed = FACE.parse(argv)
    mode, cfg = parsed.command, parsed.sections["bench"]
    out = getattr(cfg, "out", None)
    done = []

    def write(extra: dict, complete: bool) -> None:
        """The rows so far, atomically: a configuration that kills the process (out of memory) loses only itself."""
        record = {
            "rows": done,
            **extra,
            "complete": complete,
            "config": FACE.commands[mode].record({"bench": cfg})["bench"],
            "argv": sys.argv[1:] if argv is None else argv,
        }
        atomic_write_bytes(out, json.dumps(record, indent=2).encode())

    def on_row(row: dict) -> None:
        done.append(row)
        if out:
            write({}, complete=False)

    with Runtime(getattr(cfg, "device", None)):  # the process: host-memory tuning on CPU, as training has it
        result = bench.run(mode, cfg, on_row)
    if result.text is not None:
        print(result.text)
        return 0
    print(_table(result.rows, result.keys))
    for note in result.notes:
        print(note)
    if out:
        done[:] = result.rows
        write(result.extra, complete=True)
    return 0


if __name__ == "__main__":
    exit_process(run_cli(main))
