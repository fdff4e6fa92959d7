#!/usr/bin/env bash
# Starts one server on this host: `server.sh [INDEX]` (run.sh starts INDEX 0 ..
# BPS_GC_SERVERS_PER_HOST-1). Runs in the foreground as bpslaunch itself: PID in
# $BPS_GC_LOG_DIR/server<INDEX>.pid, output in server<INDEX>.log. Settings: see config.example.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"
index=${1:-0}
[[ "$index" =~ ^[0-9]+$ ]] || die "usage: server.sh [INDEX]  (INDEX: a number, got '$index')"
load_config
start_role "server$index" server
