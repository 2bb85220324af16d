"""``python -m dit.quickstart`` (``bash scripts/quickstart.sh``)."""

from dit.io.cli import run_cli
from dit.quickstart import main

raise SystemExit(run_cli(main))
