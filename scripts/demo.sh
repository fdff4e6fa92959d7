#!/usr/bin/env bash
# The main job: sets up .venv (first run only) and runs the MNIST demo (example/demo/mnist_demo.py:
# a local cluster per compression configuration; table, results.json and accuracy.png in out/demo/).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$("$root/scripts/setup_env.sh")
cd "$root"
exec "$venv/bin/python" example/demo/mnist_demo.py "$@"
