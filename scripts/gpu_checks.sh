#!/usr/bin/env bash
# The GPU acceptance run (issues 26 and 32), one command, at most 8 minutes on one H100 (each
# step has its own time limit; they add up to 480 s). Run from
# the repository root on a machine where torch.cuda.is_available(); logs, JSON and summary.md go
# to the folder given (default out/gpu). docs/gpu.md explains each step.
#   scripts/gpu_checks.sh [OUT_DIR]
#   scripts/gpu_checks.sh --cpu-dry-run OUT_DIR   # the same steps on the CPU at tiny size (the test), their
#     commands run in one Python process (scripts/gpu_checks_one_process.py: one torch import, not six)
# Steps: 1. the CUDA tests; 2. bench_device_codecs.py (1M, 25M elements); 3. the synthetic
# benchmark's suite, ResNet-50 batch 64, 1 rank and 2 ranks sharing the GPU; 4. DGC's ResNet-20
# with the printed configs, 2 ranks sharing the GPU, on both transports (ranks bit-identical, the
# loss falling); 5. scripts/gpu_summary.py: one table of every check against the targets.
set -uo pipefail
dry=0
if [[ "${1:-}" == "--cpu-dry-run" ]]; then dry=1; shift; fi
out=${1:-out/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failed=0
step() {  # step NAME TIMEOUT_S COMMAND...: run it, its output to $out/NAME.txt and the screen
  local name=$1 limit=$2; shift 2
  if [[ $dry -eq 1 ]]; then  # queued: run with the others below, in one process
    printf '%s\0' "$name" $((limit * slow)) $# "$@" >> "$queue"
    return 0
  fi
  echo "== $name: $*" | tee "$out/$name.txt"
  timeout $((limit * slow)) "$@" 2>&1 | tee -a "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  [[ $rc -ne 0 ]] && { echo "== $name: exit $rc" | tee -a "$out/$name.txt"; failed=1; }
  return 0
}
if [[ $dry -eq 1 ]]; then  # tiny sizes, the CPU; pytest only collects
  device=cpu; collect=(--collect-only); codec_device=cpu; sizes=64K; repeats=1; iters2=2
  queue=$(mktemp); trap 'rm -f "$queue"' EXIT
  slow=4  # a shared CPU box runs the ranks' processes side by side: more time for each step
  bench=(--model mlp --hidden 32 --image-size 8 --batch-size 4 --num-iters 2 --num-warmup 1 --codec-repeats 1)
  dgc=(--device cpu --images 80 --batch 8 --epochs 2 --lr 0.02)  # 10 steps: 0.1 is too large to learn in
  # the versions from the installed packages' metadata: importing torch here costs a second of CPU
  "$py" -c "import sys; from importlib.metadata import version as v; print('cpu dry run: python', sys.version.split()[0], 'numpy', v('numpy'), 'torch', v('torch'))" \
    2>&1 | tee "$out/machine.txt"
else
  device=cuda; collect=(); codec_device=cuda; sizes=1M,25M; repeats=5; iters2=5; slow=1
  bench=(--model resnet50 --batch-size 64 --num-iters 10 --num-warmup 3)
  dgc=(--device cuda)  # 1280 images, batch 32 per rank, 10 epochs: 200 steps
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$py" -c "import sys, numpy, torch; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'gpus', torch.cuda.device_count())"
    lscpu | grep -E "Model name|^CPU\(s\)"
    date -u +"%Y-%m-%d %H:%M UTC"
  } 2>&1 | tee "$out/machine.txt"
fi
# 1. every device-chain test (CPU and CUDA parameters), then the CUDA tests of the bindings, the
# hook, the examples' GPU paths (none uses hypothesis: its plugin's import is 0.6 s of CPU each)
nohyp=(-p no:hypothesispytest)
step tests_chains 60 "$py" -m pytest -q -p no:cacheprovider "${nohyp[@]}" -rs "${collect[@]}" \
    tests/test_device_chains.py tests/test_device_chains_random.py
step tests_cuda 110 "$py" -m pytest -q -p no:cacheprovider "${nohyp[@]}" -rs "${collect[@]}" -k cuda \
    tests/test_hook_async.py tests/test_device_bindings.py tests/test_collective_two_level.py tests/test_gpu_paths.py
# 2. the device chains against host copy + numpy chain
step bench_device_codecs 60 "$py" scripts/bench_device_codecs.py --device "$codec_device" --sizes "$sizes" \
    --repeats "$repeats" --json "$out/bench_device_codecs_cuda.json"
# 3. the synthetic benchmark's rows, 1 rank, then 2 ranks on the one GPU (gloo: NCCL refuses)
step synthetic_1rank 70 "$py" example/pytorch/benchmark_synthetic.py "${bench[@]}" --device "$device" --ranks 1 \
    --json "$out/synthetic_1rank.json"
step synthetic_2rank 80 "$py" example/pytorch/benchmark_synthetic.py "${bench[@]}" --num-iters "$iters2" --device "$device" --ranks 2 \
    --json "$out/synthetic_2rank.json"
# 4. DGC's ResNet-20, 2 ranks sharing the GPU, both transports
step dgc 100 "$py" scripts/dgc_shared_gpu.py "${dgc[@]}" --ranks 2 --out "$out/dgc"
if [[ $dry -eq 1 ]]; then
  "$py" scripts/gpu_checks_one_process.py "$out" "$queue" || failed=1
fi
# 5. the table
"$py" scripts/gpu_summary.py "$out" || failed=1
exit $failed
