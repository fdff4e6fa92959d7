#!/usr/bin/env bash
# The test command: sets up .venv (first run only) and runs the whole suite.
#   ./scripts/test.sh            all tests
#   ./scripts/test.sh -k vectors extra pytest arguments
#   BPS_GC_TEST_WORKERS=0 ./scripts/test.sh   one pytest process (default: 2, pytest-xdist)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$("$root/scripts/setup_env.sh")
cd "$root"
# Two pytest processes, each taking a whole test file at a time (module fixtures run once): much
# of the suite is clusters starting up and waiting on sockets, timeouts and heartbeats. The files
# go in collection order, which tests/conftest.py makes heaviest first (by earlier runs' times in
# .pytest_cache, or in a checkout without one, as CI's, by the committed tests/file_seconds.json)
# so that the last files are short ones and neither process waits long for the other at the end.
# Every launched rank, server and scheduler imports this repository's modules: with
# PYTHONDONTWRITEBYTECODE set (some shells set it) each process compiled them from source again
# (~0.1 s of CPU a process, thousands of processes); their bytecode goes to the ignored __pycache__.
unset PYTHONDONTWRITEBYTECODE
workers=${BPS_GC_TEST_WORKERS:-2}
order=()
if [ "$workers" != 0 ]; then
  order=(--no-loadscope-reorder)
fi
exec "$venv/bin/python" -m pytest -q -n "$workers" --dist loadfile "${order[@]}" "$@"
