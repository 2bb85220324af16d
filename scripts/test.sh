#!/usr/bin/env bash
# The README's test command: create .venv if missing, install the project (editable, [dev]), lint, test.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
log=$(mktemp)
if ! .venv/bin/python -m pip install -q -e ".[dev]" >"$log" 2>&1; then
    cat "$log"
    exit 1
fi
# pip's notes about index locations this machine's configuration lists but does not have are noise here.
grep -v "is ignored: it is neither a file nor a directory" "$log" || true
rm -f "$log"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
