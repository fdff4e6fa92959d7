#!/usr/bin/env bash
# Creates (once) the project's virtualenv in .venv with everything the tests and examples need:
# torch pinned to the CPU wheel (an unpinned torch pulls GBs of CUDA packages) and MXNet with
# the old pins it needs on Python 3.11. Re-running only reinstalls when setup files changed.
# Opt-in extras, for benchmarks only: BPS_GC_EXTRAS=torchft ./scripts/setup_env.sh adds torchft
# 0.2.0 (scripts/diloco_vs_torchft.py), resolved against the same pinned CPU torch.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${BPS_GC_VENV:-$root/.venv}
python=${PYTHON:-python3}
extras=${BPS_GC_EXTRAS:-}
stamp=$venv/.bps_gc-installed
want=$({ cat "$root/pyproject.toml" "$root/setup.py" "$root/scripts/setup_env.sh"; echo "$extras"; } | sha256sum | cut -c1-16)
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/pip" install -q --disable-pip-version-check \
    "torch==2.13.0" "numpy<1.24" -e "$root[torch,mxnet,test${extras:+,$extras}]" >&2
  echo "$want" > "$stamp"
else
  # the C kernels: rebuild in place if a source is newer than the build (else every process
  # of a job would hash the sources and load the per-user cache's copy: bps_gc/compress/_native.py)
  if ! "$venv/bin/python" -c "import sys, bps_gc.compress._native as n; sys.exit(n._prebuilt() is None)" >&2; then
    (cd "$root" && "$venv/bin/python" setup.py -q build_ext --inplace) >/dev/null 2>&1 \
      || "$venv/bin/python" -c "import bps_gc.compress" >&2
  fi
fi
echo "$venv"
