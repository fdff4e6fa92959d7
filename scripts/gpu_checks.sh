#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (issue 26): the CUDA tests, then the device chains'
# speed against host copy + numpy chain. Run from the repository root on a machine where
# torch.cuda.is_available(); logs and JSON go to the folder given (default out/gpu).
#   scripts/gpu_checks.sh [OUT_DIR]
set -uo pipefail
out=${1:-out/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c "import sys, numpy, torch; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'gpus', torch.cuda.device_count())"
  lscpu | grep -E "Model name|^CPU\(s\)"
} 2>&1 | tee "$out/machine.txt"
# every device-chain test (CPU and CUDA parameters), then the CUDA tests of the bindings and the hook
timeout 300 "$py" -m pytest -q -p no:cacheprovider -rs tests/test_device_chains.py tests/test_device_chains_random.py \
    2>&1 | tee "$out/tests_chains.txt"
timeout 420 "$py" -m pytest -q -p no:cacheprovider -rs -k cuda tests/test_hook_async.py tests/test_device_bindings.py \
    tests/test_collective_two_level.py 2>&1 | tee "$out/tests_cuda.txt"
timeout 300 "$py" scripts/bench_device_codecs.py --device cuda --sizes 1M,25M --json "$out/bench_device_codecs_cuda.json" \
    2>&1 | tee "$out/bench_device_codecs_cuda.txt"
