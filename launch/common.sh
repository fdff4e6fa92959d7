# Sourced by run.sh, scheduler.sh, server.sh and worker.sh: the settings and shared helpers.
#
# Settings come from the environment, then from a config file that fills in what the
# environment left unset: $BPS_GC_LAUNCH_CONFIG, else launch/config if it exists (copy
# config.example). Over pssh the environment does not travel, so the file is the usual way.
# shellcheck shell=bash

launch_dir=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)
repo_root=$(dirname "$launch_dir")
prog=$(basename "$0")

die() {
  echo "$prog: $*" >&2
  exit 2
}

say() {
  echo "$prog: $*" >&2
}

load_config() {
  local config=${BPS_GC_LAUNCH_CONFIG:-}
  if [[ -z "$config" && -f "$launch_dir/config" ]]; then
    config=$launch_dir/config
  fi
  if [[ -n "$config" ]]; then
    [[ -r "$config" ]] || die "BPS_GC_LAUNCH_CONFIG: cannot read $config"
    # shellcheck source=/dev/null
    source "$config"
  fi

  : "${BPS_GC_LOG_DIR:=$launch_dir/logs}"
  : "${BPS_GC_KILL_GRACE:=5}"
  [[ "$BPS_GC_KILL_GRACE" =~ ^[0-9]+(\.[0-9]*)?$ ]] || die "BPS_GC_KILL_GRACE must be a number of seconds, got '$BPS_GC_KILL_GRACE'"
  [[ "${1:-}" != --logs-only ]] || return 0 # `run.sh stop` needs no more

  # Required: the scheduler's address is the one thing we cannot guess for a cluster.
  [[ -n "${DMLC_PS_ROOT_URI:-}" ]] || die "DMLC_PS_ROOT_URI is not set (the scheduler host's address; set it in the environment or the config file)"
  : "${DMLC_PS_ROOT_PORT:=1234}"
  : "${BPS_GC_HOSTS_FILE:=$launch_dir/hosts}"
  : "${BPS_GC_SERVERS_PER_HOST:=2}"
  : "${BPS_GC_TRAIN_SCRIPT:=$repo_root/example/mxnet/train_cifar100_byteps_gc.py}"
  : "${BPS_GC_DATA_DIR:=}"
  : "${BPS_GC_TRAIN_ARGS:=}"
  : "${BPS_GC_HOST_ADDR:=}"
  : "${BPS_GC_DRY_RUN:=0}"
  : "${BPS_GC_FOLLOW:=1}"
  : "${BPS_GC_SHUTDOWN_TIMEOUT:=30}"
  # run.sh always starts servers, so the job must use them even with a single worker process
  # (otherwise nothing leaves the worker and the servers wait for it forever).
  : "${BYTEPS_FORCE_DISTRIBUTED:=1}"

  if [[ -z "${BPS_GC_PYTHON:-}" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then
      BPS_GC_PYTHON=$repo_root/.venv/bin/python
    else
      BPS_GC_PYTHON=python3
    fi
  fi
  # bpslaunch as an argv prefix: the one next to the python, on PATH, or the module
  if [[ -n "${BPS_GC_BPSLAUNCH:-}" ]]; then
    read -r -a bpslaunch_cmd <<<"$BPS_GC_BPSLAUNCH"
  elif [[ "$BPS_GC_PYTHON" == */* && -x "$(dirname "$BPS_GC_PYTHON")/bpslaunch" ]]; then
    bpslaunch_cmd=("$(dirname "$BPS_GC_PYTHON")/bpslaunch")
  elif command -v bpslaunch >/dev/null 2>&1; then
    bpslaunch_cmd=(bpslaunch)
  else
    bpslaunch_cmd=("$BPS_GC_PYTHON" -m bps_gc.launcher.cli)
  fi

  [[ "$BPS_GC_SERVERS_PER_HOST" =~ ^[0-9]+$ ]] || die "BPS_GC_SERVERS_PER_HOST must be an integer, got '$BPS_GC_SERVERS_PER_HOST'"
  [[ "$BPS_GC_SHUTDOWN_TIMEOUT" =~ ^[0-9]+(\.[0-9]*)?$ ]] || die "BPS_GC_SHUTDOWN_TIMEOUT must be a number of seconds, got '$BPS_GC_SHUTDOWN_TIMEOUT'"
  read_hosts
  if [[ -z "${DMLC_NUM_WORKER:-}" ]]; then
    ((${#hosts[@]} > 0)) || die "DMLC_NUM_WORKER is not set and there is no hosts file ($BPS_GC_HOSTS_FILE) to count"
    DMLC_NUM_WORKER=${#hosts[@]}
  fi
  if [[ -z "${DMLC_NUM_SERVER:-}" ]]; then
    # every host runs BPS_GC_SERVERS_PER_HOST servers (run.sh)
    DMLC_NUM_SERVER=$((BPS_GC_SERVERS_PER_HOST * (${#hosts[@]} > 0 ? ${#hosts[@]} : DMLC_NUM_WORKER)))
  fi
  is_count "$DMLC_NUM_WORKER" || die "DMLC_NUM_WORKER must be a positive integer, got '$DMLC_NUM_WORKER'"
  is_count "$DMLC_NUM_SERVER" || die "DMLC_NUM_SERVER must be a positive integer, got '$DMLC_NUM_SERVER'"

  export DMLC_PS_ROOT_URI DMLC_PS_ROOT_PORT DMLC_NUM_WORKER DMLC_NUM_SERVER BYTEPS_FORCE_DISTRIBUTED
  export BPS_GC_KILL_GRACE BPS_GC_SHUTDOWN_TIMEOUT
  if [[ -n "${DMLC_INTERFACE:-}" ]]; then export DMLC_INTERFACE; fi
}

is_count() {
  [[ "$1" =~ ^[0-9]+$ ]] && ((10#$1 > 0))
}

dry_run() {
  [[ "$BPS_GC_DRY_RUN" == 1 ]]
}

# hosts: the addresses in the hosts file, in order. Lines are `[user@]host[:ssh-port]` as pssh
# reads them; `#` starts a comment.
read_hosts() {
  hosts=()
  [[ -f "$BPS_GC_HOSTS_FILE" ]] || return 0
  local line
  while IFS= read -r line || [[ -n "$line" ]]; do
    line=${line%%#*}
    line=${line//[[:space:]]/}
    [[ -n "$line" ]] || continue
    line=${line#*@}
    if [[ "$line" =~ ^\[(.*)\](:[0-9]+)?$ ]]; then
      line=${BASH_REMATCH[1]}           # [ipv6]:port
    elif [[ "$line" == *:* && "$line" != *:*:* ]]; then
      line=${line%:*}                   # host:port (one colon: not an IPv6 address)
    fi
    hosts+=("$line")
  done <"$BPS_GC_HOSTS_FILE"
}

# The names and addresses this host answers to (BPS_GC_HOST_ADDR, when set, is the only one).
local_addresses() {
  if [[ -n "$BPS_GC_HOST_ADDR" ]]; then
    echo "$BPS_GC_HOST_ADDR"
    return
  fi
  printf '%s\n' 127.0.0.1 ::1 localhost
  hostname 2>/dev/null || true
  hostname -f 2>/dev/null || true
  if command -v ip >/dev/null 2>&1; then
    ip -o addr show 2>/dev/null | awk '{split($4, a, "/"); print a[1]}'
  else
    hostname -I 2>/dev/null | tr ' ' '\n'
  fi
}

is_local() {
  local want=$1 addr
  while IFS= read -r addr; do
    [[ -n "$addr" && "$addr" == "$want" ]] && return 0
  done < <(local_addresses)
  return 1
}

is_root_host() {
  is_local "$DMLC_PS_ROOT_URI"
}

# This host's DMLC_WORKER_ID: WORKER_ID or DMLC_WORKER_ID from the environment, else the
# position (from 0) of the first hosts-file line naming this host.
worker_id() {
  local id=${WORKER_ID:-${DMLC_WORKER_ID:-}} i
  if [[ -z "$id" ]]; then
    for i in "${!hosts[@]}"; do
      if is_local "${hosts[$i]}"; then
        id=$i
        break
      fi
    done
  fi
  [[ -n "$id" ]] || die "cannot tell this host's worker id: none of its addresses is in $BPS_GC_HOSTS_FILE (set WORKER_ID or BPS_GC_HOST_ADDR)"
  [[ "$id" =~ ^[0-9]+$ ]] && ((id < DMLC_NUM_WORKER)) || die "worker id $id is not in [0, DMLC_NUM_WORKER=$DMLC_NUM_WORKER)"
  echo "$id"
}

# job_args: the training script's compressor flags for a job name (BytePS's seed guide).
# `fp16` anywhere in the name adds --fp16-pushpull: onebit_fp16, fp16 (= baseline_fp16).
job_flags() {
  local name=$1 base
  base=${name//fp16/}
  base=${base##[_.-]}
  base=${base%%[_.-]}
  case "$base" in
    baseline | "") job_args=() ;;
    onebit) job_args=(--compressor onebit --onebit-scaling --ef vanilla --compress-momentum nesterov) ;;
    topk) job_args=(--compressor topk --k 0.001 --ef vanilla) ;;
    randomk) job_args=(--compressor randomk --k 0.001 --ef vanilla) ;;
    dithering) job_args=(--compressor dithering --k 2) ;;
    *) die "unknown job name '$name': use baseline, onebit, topk, randomk or dithering, with _fp16 for fp16 push_pull" ;;
  esac
  if [[ "$name" == *fp16* ]]; then
    job_args+=(--fp16-pushpull)
  fi
}

# Role processes: $BPS_GC_LOG_DIR/<label>.pid holds the PID, <label>.log the output.
pid_file() {
  echo "$BPS_GC_LOG_DIR/$1.pid"
}

log_file() {
  echo "$BPS_GC_LOG_DIR/$1.log"
}

# is_running PID: alive and not a zombie (a child run.sh has not reaped yet still answers kill -0)
is_running() {
  local pid=$1 stat
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [[ "${stat%% *}" != Z ]]
}

# is_ours PID: running, and its command line is one of our scripts or bpslaunch (a PID from an
# old file may have been reused by something else).
is_ours() {
  local pid=$1 cmdline
  is_running "$pid" || return 1
  cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ "$cmdline" == *bpslaunch* || "$cmdline" == *bps_gc.launcher* || "$cmdline" == *"$launch_dir"/* ||
    "$cmdline" == *run.sh* || "$cmdline" == *scheduler.sh* || "$cmdline" == *server.sh* || "$cmdline" == *worker.sh* ]]
}

running_pid() {
  local file pid
  file=$(pid_file "$1")
  [[ -f "$file" ]] || return 1
  pid=$(cat "$file" 2>/dev/null) || return 1
  is_ours "$pid" || return 1
  echo "$pid"
}

write_pid() {
  local file
  file=$(pid_file "$1")
  echo "$2" >"$file.tmp.$$"
  mv -f "$file.tmp.$$" "$file"
}

# start_role LABEL ROLE [CMD...]: replace this shell with `bpslaunch [CMD...]` for ROLE, so the
# PID written to LABEL.pid is bpslaunch's own (it forwards SIGTERM to what it started).
start_role() {
  local label=$1 role=$2 pid
  shift 2
  local -a argv=("${bpslaunch_cmd[@]}" "$@")
  if dry_run; then
    printf '%s: DMLC_ROLE=%s' "$label" "$role"
    local var
    for var in DMLC_NUM_WORKER DMLC_NUM_SERVER DMLC_PS_ROOT_URI DMLC_PS_ROOT_PORT DMLC_INTERFACE DMLC_WORKER_ID BYTEPS_FORCE_DISTRIBUTED; do
      if [[ -n "${!var:-}" ]]; then printf ' %s=%q' "$var" "${!var}"; fi
    done
    printf ' %q' "${argv[@]}"
    printf '\n'
    return 0
  fi
  mkdir -p "$BPS_GC_LOG_DIR"
  if pid=$(running_pid "$label") && [[ "$pid" != $$ ]]; then
    die "$label is already running (pid $pid); stop it first: $launch_dir/run.sh stop"
  fi
  write_pid "$label" $$
  exec >>"$(log_file "$label")" 2>&1
  echo "== $(date '+%F %T') $label on $(hostname): DMLC_ROLE=$role ${argv[*]}"
  export DMLC_ROLE=$role
  exec "${argv[@]}"
}
