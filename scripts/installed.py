"""Exit 0 if every named install set of setup.cfg (or distribution, such as mlxtend) is in this Python, so that an
older .venv gets what setup.cfg adds: `python scripts/installed.py core dev`. Standard library only."""

import configparser
import importlib.metadata
import re
import sys
from pathlib import Path


def requirements(names: list[str]) -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    extras = cfg["options.extras_require"]
    out = ["dit-ledger"]
    for name in names:
        text = cfg["options"]["install_requires"] if name == "core" else extras.get(name, name)
        out += [re.match(r"[A-Za-z0-9._-]+", line.strip()).group() for line in text.splitlines() if line.strip()]
    return out


def main(names: list[str]) -> int:
    missing = []
    for dist in requirements(names):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
    if missing:
        print(f"not installed: {', '.join(missing)}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
