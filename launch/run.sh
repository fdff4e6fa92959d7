#!/usr/bin/env bash
# One host's share of a job, BytePS seed-guide style; run it on every host at once:
#
#   pssh -i -h launch/hosts -l ubuntu 'bps_gc/launch/run.sh onebit'
#
#   run.sh [--dry-run] JOB   start the scheduler (only on the host whose address is
#                            DMLC_PS_ROOT_URI), BPS_GC_SERVERS_PER_HOST servers and one worker
#                            training with JOB's flags (baseline, onebit, topk, randomk,
#                            dithering; `fp16` in the name adds --fp16-pushpull); wait for the
#                            worker, give the others BPS_GC_SHUTDOWN_TIMEOUT s to exit, stop
#                            whatever is left. Exit status: the worker's, else 1 if another
#                            role failed. --dry-run (or BPS_GC_DRY_RUN=1) prints the commands.
#   run.sh stop              stop what a run.sh on this host started (by the PIDs it recorded)
#
# Settings: environment or config file, see config.example. Logs and PID files go to
# BPS_GC_LOG_DIR (launch/logs); the worker's log is also shown here (BPS_GC_FOLLOW=0: not).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"

usage() {
  echo "usage: $prog [--dry-run] JOB | $prog stop    (JOB: baseline, onebit, topk, randomk, dithering, optionally with _fp16)" >&2
  exit 2
}

# terminate LABEL=PID...: SIGTERM each process that is still running, SIGKILL it after
# bpslaunch's own grace (it needs that long to stop its children) plus a margin.
terminate() {
  local item pid deadline
  local -a live=()
  for item in "$@"; do
    pid=${item#*=}
    if is_running "$pid"; then
      say "stopping ${item%%=*} (pid $pid)"
      kill -TERM "$pid" 2>/dev/null || true
      live+=("$pid")
    fi
  done
  deadline=$((SECONDS + ${BPS_GC_KILL_GRACE%.*} + 5))
  for pid in "${live[@]}"; do
    while is_running "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
    if is_running "$pid"; then
      say "pid $pid ignored SIGTERM; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}

# stop_recorded LABEL...: terminate the processes named by PID files (checked to be ours)
stop_recorded() {
  local label pid
  local -a items=()
  for label in "$@"; do
    if pid=$(running_pid "$label"); then items+=("$label=$pid"); fi
  done
  terminate "${items[@]}"
  for label in "$@"; do
    if ! running_pid "$label" >/dev/null; then rm -f "$(pid_file "$label")"; fi
  done
}

if [[ "${1:-}" == stop ]]; then
  (($# == 1)) || usage
  load_config --logs-only
  # run.sh and its roles together (the roles may have been started by hand, too)
  labels=()
  for file in "$BPS_GC_LOG_DIR"/*.pid; do
    if [[ -f "$file" ]]; then
      label=$(basename "$file" .pid)
      labels+=("$label")
    fi
  done
  stop_recorded "${labels[@]}"
  exit 0
fi
if [[ "${1:-}" == --dry-run ]]; then
  BPS_GC_DRY_RUN=1
  shift
fi
(($# == 1)) || usage
job=$1
[[ "$job" != -* ]] || usage
load_config
job_flags "$job" # reject an unknown job name before starting anything

if dry_run; then
  export BPS_GC_DRY_RUN
  if is_root_host; then "$launch_dir/scheduler.sh"; fi
  for ((i = 0; i < BPS_GC_SERVERS_PER_HOST; i++)); do "$launch_dir/server.sh" "$i"; done
  "$launch_dir/worker.sh" "$job"
  exit 0
fi

# the worker's configuration errors, before starting servers that would wait for it
worker_id >/dev/null
[[ -f "$BPS_GC_TRAIN_SCRIPT" ]] || die "BPS_GC_TRAIN_SCRIPT: no such file: $BPS_GC_TRAIN_SCRIPT"

mkdir -p "$BPS_GC_LOG_DIR"
if pid=$(running_pid run) && [[ "$pid" != $$ ]]; then
  die "a run.sh is already running here (pid $pid); stop it first: $launch_dir/run.sh stop"
fi
write_pid run $$

declare -A pids=() # label -> PID of what we started
tail_pid=

cleanup() {
  local status=$? label
  local -a items=()
  trap - EXIT INT TERM
  if [[ -n "$tail_pid" ]]; then kill "$tail_pid" 2>/dev/null || true; fi
  # our own children: their PIDs are known even if a role script had no time to write its file
  for label in "${!pids[@]}"; do items+=("$label=${pids[$label]}"); done
  terminate "${items[@]}"
  for label in "${!pids[@]}"; do
    wait "${pids[$label]}" 2>/dev/null || true
    rm -f "$(pid_file "$label")"
  done
  if [[ -n "$tail_pid" ]]; then wait "$tail_pid" 2>/dev/null || true; fi
  rm -f "$(pid_file run)"
  exit "$status"
}
trap cleanup EXIT
# a signal stops everything (cleanup, through the EXIT trap) with the shell's status for it
trap 'say "interrupted"; exit 130' INT
trap 'say "terminated"; exit 143' TERM

# start LABEL SCRIPT [ARGS...]: run a role script in the background; its log starts empty
start() {
  local label=$1
  shift
  : >"$(log_file "$label")"
  "$@" </dev/null &
  pids[$label]=$!
  say "started $label (pid ${pids[$label]}, log $(log_file "$label"))"
}

if is_root_host; then
  start scheduler "$launch_dir/scheduler.sh"
fi
for ((i = 0; i < BPS_GC_SERVERS_PER_HOST; i++)); do
  start "server$i" "$launch_dir/server.sh" "$i"
done
start worker "$launch_dir/worker.sh" "$job"
if [[ "$BPS_GC_FOLLOW" == 1 ]]; then
  # show the worker's output as it comes; tail exits by itself once the worker is gone
  tail -n +1 -s 0.2 -f --pid="${pids[worker]}" "$(log_file worker)" &
  tail_pid=$!
fi

status=0
wait "${pids[worker]}" || status=$?
if [[ -n "$tail_pid" ]]; then
  wait "$tail_pid" || true
  tail_pid=
fi
say "worker exited with status $status"
worker_status=$status
rm -f "$(pid_file worker)"
unset 'pids[worker]'

# The scheduler and servers exit by themselves once every worker of the job said goodbye;
# whatever is left then gets stopped. After a failed worker the job cannot go on: stop them now
# (the other hosts' nodes then notice within the heartbeat timeout instead of waiting).
if ((worker_status != 0)); then
  items=()
  for label in "${!pids[@]}"; do items+=("$label=${pids[$label]}"); done
  terminate "${items[@]}"
fi
deadline=$((SECONDS + ${BPS_GC_SHUTDOWN_TIMEOUT%.*}))
for label in "${!pids[@]}"; do
  pid=${pids[$label]}
  role_status=0
  while is_running "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
  if is_running "$pid"; then
    say "$label still running ${BPS_GC_SHUTDOWN_TIMEOUT} s after the worker finished; stopping it"
    terminate "$label=$pid"
    role_status=1
  fi
  wait "$pid" || role_status=$?
  if ((worker_status == 0 && role_status != 0)); then
    say "$label exited with status $role_status"
    status=1
  fi
  rm -f "$(pid_file "$label")"
  unset 'pids[$label]'
done
exit "$status"
