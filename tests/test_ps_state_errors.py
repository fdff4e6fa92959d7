"""Bad states given to bps_gc.core.load_state_dict on the parameter server (issue 33): each is
refused with a StateError naming the problem, before anything is loaded on the worker or the
servers (tests/ps_state_errors_job.py checks that, 2 workers, 2 servers); the documented
BPS_GC_RESUME_DROP_RANK_STATE=1 drops each rank's chains and keeps the servers' state."""
import json
import os
import sys

from cluster import run_local
from conftest import ROOT

JOB = os.path.join(ROOT, "tests", "ps_state_errors_job.py")
EXPECTED = {
    "truncated": "truncated",
    "corrupt": "bps_gc state",
    "other_setting": "'k' is 0.05 in the state, 0.1 here",
    "world_size": "a job with workers 3; this job has 2 (set BPS_GC_RESUME_DROP_RANK_STATE=1",
    "other_rank": "each rank loads its own state",
    "transport": "meta.transport is 'collective', here 'ps'",
    "undeclared": "the state holds tensor 'z', which is not declared",
    "missing": "the state lacks tensor 'y', which is declared here with codec state",
    "partitions": "tensor 'x' has 1 partition(s) in the state, 2 here",
    "after_push": "load_state_dict() after the first push_pull of 'x'",
}
RANK0 = {
    "server_part": "the servers' state of 'y' partition 0",
    "server_refuses_junk": "server 0: the state of key 0 ('x#0') was refused: not a bps_gc state",
    "server_after_round": "is at round 1: its state is restored before its first round only",
}


def test_bad_states_are_refused_whole(tmp_path):
    env = {"BYTEPS_PARTITION_BYTES": "4096", "BYTEPS_MIN_COMPRESS_BYTES": "0"}
    result = run_local([sys.executable, JOB, str(tmp_path)], workers=2, servers=2, env=env, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    # one warning line per rank
    assert (result.stdout + result.stderr).count("BPS_GC_RESUME_DROP_RANK_STATE=1)") == 2
    for rank in range(2):
        errors = json.load(open(tmp_path / f"errors{rank}.json"))
        for case, text in {**EXPECTED, **(RANK0 if rank == 0 else {})}.items():
            assert errors.get(case) and text in errors[case], (rank, case, errors.get(case))
        assert errors["drop_kept_worker"] and errors["drop_loaded_server"] and errors["loaded"], errors
