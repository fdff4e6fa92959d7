#!/usr/bin/env bash
# The main job: sets up .venv (first run only) and runs the codec benchmark.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$("$root/scripts/setup_env.sh")
cd "$root"
exec "$venv/bin/python" scripts/bench_codecs.py "$@"
