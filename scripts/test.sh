#!/usr/bin/env bash
# The test command: sets up .venv (first run only) and runs the whole suite.
#   ./scripts/test.sh            all tests
#   ./scripts/test.sh -k vectors extra pytest arguments
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$("$root/scripts/setup_env.sh")
cd "$root"
exec "$venv/bin/python" -m pytest -q "$@"
