#!/usr/bin/env bash
# Starts this host's worker: `worker.sh [JOB]` runs the training script under bpslaunch with
# the compressor flags of JOB (baseline, onebit, topk, randomk, dithering; `fp16` in the name
# adds --fp16-pushpull). Runs in the foreground as bpslaunch itself: PID in
# $BPS_GC_LOG_DIR/worker.pid, output in worker.log. DMLC_WORKER_ID comes from WORKER_ID (or
# DMLC_WORKER_ID) in the environment, else from this host's line in the hosts file.
#
# The command: $BPS_GC_PYTHON $BPS_GC_TRAIN_SCRIPT [--data-dir $BPS_GC_DATA_DIR]
#              --logging-file JOB <JOB's flags> $BPS_GC_TRAIN_ARGS
# (BPS_GC_TRAIN_ARGS last, so it can override; split on whitespace, no quoting.)
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"
job=${1:-baseline}
load_config
job_flags "$job"
DMLC_WORKER_ID=$(worker_id)
export DMLC_WORKER_ID

command=("$BPS_GC_PYTHON" "$BPS_GC_TRAIN_SCRIPT")
if [[ -n "$BPS_GC_DATA_DIR" ]]; then
  command+=(--data-dir "$BPS_GC_DATA_DIR")
fi
command+=(--logging-file "$job" "${job_args[@]}")
read -r -a extra <<<"$BPS_GC_TRAIN_ARGS"
command+=("${extra[@]}")
# a missing script would otherwise only show up as the training process' exit status 2
[[ -f "$BPS_GC_TRAIN_SCRIPT" ]] || dry_run || die "BPS_GC_TRAIN_SCRIPT: no such file: $BPS_GC_TRAIN_SCRIPT"
start_role worker worker "${command[@]}"
