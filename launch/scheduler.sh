#!/usr/bin/env bash
# Starts this job's scheduler on this host (run.sh does so only where the host's address is
# DMLC_PS_ROOT_URI). Runs in the foreground as bpslaunch itself: PID in
# $BPS_GC_LOG_DIR/scheduler.pid, output in scheduler.log. Settings: see config.example.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/common.sh"
load_config
start_role scheduler scheduler
