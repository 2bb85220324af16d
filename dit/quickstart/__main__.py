"""``python -m dit.quickstart`` (``bash scripts/quickstart.sh``)."""

from dit.io.cli import exit_process, run_cli
from dit.quickstart import main

exit_process(run_cli(main))
