#!/usr/bin/env bash
# The main job: sets up .venv (first run only) and runs the MNIST demo (example/demo/mnist_demo.py:
# a local cluster per compression configuration; table, results.json and accuracy.png in out/demo/).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv_dir=${BPS_GC_VENV:-$root/.venv}
if [ ! -f "$venv_dir/.bps_gc-installed" ]; then  # setup_env.sh's stamp of a finished install
  echo "demo.sh: first run: installing torch 2.13.0 (CPU wheel), MXNet 1.9.1, numpy, pyzmq and the" \
       "test tools into $venv_dir (about 1.8 GB; a minute or more), then the demo starts" >&2
fi
venv=$("$root/scripts/setup_env.sh")
cd "$root"
exec "$venv/bin/python" example/demo/mnist_demo.py "$@"
