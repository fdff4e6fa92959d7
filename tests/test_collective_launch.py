"""Starting the collective transport: the environment picks it (torchrun's variables,
DMLC_NUM_SERVER=0, BPS_GC_TRANSPORT), and one training run gives the same parameters under
torchrun, under ``bpslaunch --local --servers 0`` and on the parameter server."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cluster import run_local
from collective_cluster import TESTS, bpslaunch_argv, job_env, runs_job_argv, torchrun_argv
from conftest import ROOT

from bps_gc.config import ConfigError, transport_from_env

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
DMLC_ENV = {"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": "9000", "DMLC_WORKER_ID": "0"}


@pytest.mark.parametrize("env, transport", [
    (TORCHRUN_ENV, "collective"),
    (DMLC_ENV, "ps"),
    (dict(DMLC_ENV, DMLC_NUM_SERVER="0"), "collective"),
    (dict(TORCHRUN_ENV, **DMLC_ENV), "ps"),  # bpslaunch's variables win over stray torchrun ones
    (dict(TORCHRUN_ENV, BPS_GC_TRANSPORT="ps"), "ps"),
    (dict(DMLC_ENV, BPS_GC_TRANSPORT="collective"), "collective"),
    ({}, "ps"),
])
def test_transport_from_env(env, transport):
    assert transport_from_env(env) == transport


def test_unknown_transport_is_named():
    with pytest.raises(ConfigError, match="BPS_GC_TRANSPORT"):
        transport_from_env({"BPS_GC_TRANSPORT": "mpi"})


def test_torchrun_variables_map_to_the_config():
    from bps_gc.collective import collective_config
    cfg, local_rank, local_size = collective_config(dict(TORCHRUN_ENV, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2"))
    assert (cfg.rank, cfg.size, cfg.root_uri, cfg.root_port) == (1, 2, "127.0.0.1", 29500)
    assert (local_rank, local_size) == (1, 2)
    cfg, local_rank, local_size = collective_config(dict(DMLC_ENV, DMLC_NUM_SERVER="0", DMLC_WORKER_ID="1"))
    assert (cfg.rank, cfg.size, cfg.root_port, local_rank, local_size) == (1, 2, 9000, 0, 1)


SPEC = {"steps": 4, "configs": [
    {"name": "dense", "optimizer": {"lr": 0.1, "momentum": 0.9}},
    {"name": "onebit", "optimizer": {"lr": 0.1}, "compression_params": {"compressor": "onebit", "scaling": True, "ef": "vanilla"}},
    {"name": "topk", "optimizer": {"lr": 0.1}, "compression_params": {"compressor": "topk", "k": 0.25}},
]}


def write_spec(folder):
    (folder / "spec.json").write_text(json.dumps(SPEC))
    return str(folder / "spec.json")


TORCH_JOB_ENV = {"BYTEPS_MIN_COMPRESS_BYTES": "0"}


@pytest.fixture(scope="module")
def torchrun_launch(tmp_path_factory):
    """One torchrun launch of 2 ranks (tests/runs_job.py: they start once), two runs on the
    process group the job made: tests/torch_job.py with SPEC (its results in the folder), for
    test_same_parameters_under_torchrun_bpslaunch_and_the_parameter_server, then
    tests/adopted_group_job.py, for test_two_runs_on_one_adopted_group. (folder, result)."""
    folder = tmp_path_factory.mktemp("torchrun")
    runs = [{"script": os.path.join(TESTS, "torch_job.py"), "cwd": str(folder),
             "argv": [write_spec(folder), str(folder)], "env": TORCH_JOB_ENV},
            {"script": os.path.join(TESTS, "adopted_group_job.py"), "cwd": str(folder), "argv": []}]
    result = subprocess.run(torchrun_argv(runs_job_argv(runs, folder), 2), env=job_env(), capture_output=True,
                            text=True, timeout=180, cwd=ROOT)
    return folder, result


def train(tmp_path, launcher, torchrun_launch):
    if launcher == "torchrun":
        out, result = torchrun_launch
    else:
        out = tmp_path / launcher
        out.mkdir()
        script = [os.path.join(TESTS, "torch_job.py"), write_spec(tmp_path), str(out)]
        if launcher == "ps":
            result = run_local([sys.executable, *script], workers=2, servers=1, env=TORCH_JOB_ENV)
        else:
            result = subprocess.run(bpslaunch_argv(script, 2), env=job_env(TORCH_JOB_ENV), capture_output=True,
                                    text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, f"{launcher} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return [dict(np.load(out / f"torch{r}.npz")) for r in range(2)]


def test_same_parameters_under_torchrun_bpslaunch_and_the_parameter_server(tmp_path, torchrun_launch):
    runs = {launcher: train(tmp_path, launcher, torchrun_launch) for launcher in ("torchrun", "bpslaunch", "ps")}
    reference = runs["torchrun"][0]
    final = [k for k in reference if f"/{SPEC['steps'] - 1}/param/" in k]
    assert len(final) == 12
    for launcher, results in runs.items():
        for rank, saved in enumerate(results):
            for key in final:
                assert saved[key].tobytes() == reference[key].tobytes(), f"{launcher} rank {rank} {key}"
    # and training moved the parameters
    assert not np.array_equal(reference[final[0]], reference[final[0].replace(f"{SPEC['steps'] - 1}/param", "init")])


def test_send_recv_broadcast_barrier_all_reduce(tmp_path):
    ranks = 3
    # bpslaunch --servers 0: the calls on torch.distributed without torchrun's agent (~0.9 s of CPU)
    argv = bpslaunch_argv([os.path.join(TESTS, "collective_p2p_job.py"), str(tmp_path)], ranks)
    result = subprocess.run(argv, env=job_env(), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(ranks):
        got = json.loads((tmp_path / f"p2p{rank}.json").read_text())
        left = (rank - 1) % ranks
        assert got["model"] == [[left * 10.0] * 3, [left * 10.0 + 1] * 4]
        assert got["other"] == f"from {left}"
        assert got["broadcast"] == [1.0] * 5
        assert got["all_reduce"] == (np.arange(4) * sum(r + 1 for r in range(ranks))).tolist()
        # its rendezvous port stays bound: refused at the call, not an "address in use" later
        assert got["init after shutdown"].startswith("bps_gc: init() after shutdown() in one process: the process "
                                                     "group init() made keeps its rendezvous port bound"), got


def test_two_runs_on_one_adopted_group(torchrun_launch):
    """bps.init() and shutdown() twice on the process group the job made (after torch_job.py's
    run on it, torchrun_launch): the second run's heartbeat does not take the first run's endings
    for ranks leaving it (rank 1, late to a collective, kept rank 0 waiting across heartbeats),
    and both runs sum right (numpy: 1 + 2 + 2i);
    each run's objects are named as a fresh process's, and the first run's, still alive, are no
    part of the second run's state."""
    _, result = torchrun_launch
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    for rank in range(2):
        for run, collectives in ((1, 2), (2, 4)):
            expected = [float(np.sum([r + 1 + i for r in range(2)])) for i in range(collectives)]
            assert f"rank {rank} run {run} sums {expected}" in result.stdout, result.stdout
        # each run's exchange is named as a fresh process names it, so either run's checkpoint resumes in one
        names = [line.split(" state ", 1)[1] for line in result.stdout.splitlines()
                 if line.startswith((f"rank {rank} run 1 state [", f"rank {rank} run 2 state ["))]
        assert len(names) == 2 and names[0] == names[1] and "'exchange.0/" in names[0], result.stdout
        for run in (1, 2):
            assert f"rank {rank} run {run} objects before its exchange []" in result.stdout, result.stdout
