"""Issue 33: N steps straight equal N/2 steps, a checkpoint, new processes resuming from it,
N/2 more: the same parameters, bit for bit, on every rank, on torch.distributed (2 gloo ranks;
2 hosts x 2 ranks with two levels, resumed under either launcher from one bpslaunch straight
run). tests/restart_job.py trains every case side by side; the oracle is the straight run
(which wrote the checkpoint on its way). On 2 ranks one torchrun --max-restarts 1 launch holds
torch elastic's restart (its first phase, killed and resumed) and, in its restarted processes,
the numpy and the torch codec chains' straight runs; their resumed runs (and the resumption
without codec state, and a 1-rank job refusing states that do not fit) share another launch,
under bpslaunch --servers 0 (no torchrun agent: 1.2 s of CPU a launch): restart_job.py runs
phases in turn."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from collective_cluster import TESTS, bpslaunch_argv, job_env, torchrun_argv
from collective_hosts import CollectiveHostsJob
from conftest import ROOT
from local_ranks import HostsJob, machines  # noqa: F401
from multihost import Job

JOB = os.path.join(TESTS, "restart_job.py")
TOPK_EF = {"compressor": "topk", "k": 0.2, "ef": "vanilla"}
CASES = {
    "dense_hook": {"case": "hook"},
    "topk_ef_hook": {"case": "hook", "compression_params": TOPK_EF, "bucket_cap_mb_second": 0.05},
    "randomk_ef_hook": {"case": "hook", "compression_params": {"compressor": "randomk", "k": 0.2, "ef": "vanilla"}},
    "dithering": {"case": "optimizer", "compression_params": {"compressor": "dithering", "k": 4}},
    "dgc": {"case": "optimizer", "momentum": 0.0, "compression_params": {"compressor": "dgc", "k": 0.1, "mu": 0.9}},
    "powersgd": {"case": "optimizer", "momentum": 0.0, "compression_params": {"compressor": "powersgd", "rank": 1}},
    "onebit_ef_nesterov": {"case": "optimizer", "compression_params": {
        "compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov"}},
    "choco": {"case": "choco", "compression_params": {"compressor": "topk", "k": 0.2}},
    "local_sgd": {"case": "local_sgd", "compression_params": {"compressor": "signnorm", "ef": "vanilla"}},
    "thc_hook": {"case": "hook", "compression_params": {"compressor": "thc", "bits": 4, "rotate": True}},
    "thc": {"case": "optimizer", "momentum": 0.0, "compression_params": {"compressor": "thc", "bits": 2}},
    # the other codecs, so that every one is launched twice (runs repeat: the elastic test, the
    # parameter server's)
    "randomk": {"case": "optimizer", "compression_params": {"compressor": "randomk", "k": 0.3}},
    "terngrad": {"case": "optimizer", "compression_params": {"compressor": "terngrad"}},
    "qsgd": {"case": "optimizer", "compression_params": {"compressor": "qsgd", "levels": 4}},
    "sign_ef": {"case": "optimizer", "compression_params": {"compressor": "sign", "ef": "vanilla"}},
    "threshold": {"case": "optimizer", "compression_params": {"compressor": "threshold", "threshold": 0.01}},
    "adaptive_threshold": {"case": "optimizer", "compression_params": {"compressor": "adaptive_threshold"}},
    "identity": {"case": "optimizer", "compression_params": {"compressor": "identity"}},  # DiLoCo's dense on servers
}
PS_CASES = {name: case for name, case in CASES.items() if case["case"] != "hook"}  # the hook is torch.distributed's
# several partitions: a 40 x 30 weight's 4,800 bytes in 3 (1,024 bytes gave 5, and the straight
# run's bps_gc state 1,827 keys instead of 1,308, repeated in every optimizer's state: CPU seconds
# in each process that saves or loads it)
SMALL = {"BYTEPS_MIN_COMPRESS_BYTES": "0", "BYTEPS_PARTITION_BYTES": "2048"}


def run_phase(spec, tmp_path, phase, ranks=2, env=None, restarts=None):
    """``phase`` (or phases, "second,without_state": in turn in the same processes) on ``ranks``,
    under bpslaunch; under torchrun --max-restarts ``restarts`` when given."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    job = [JOB, str(spec_path), str(tmp_path), phase]
    argv = bpslaunch_argv(job, ranks) if restarts is None else torchrun_argv(job, ranks)
    if restarts is not None:
        argv[argv.index("--standalone") + 1:argv.index("--standalone") + 1] = ["--max-restarts", str(restarts)]
    # a 10 s heartbeat: these runs check results, not fault detection (a 3 s one once timed out
    # on both ranks of a device-chains run beside the rest of the suite)
    result = subprocess.run(argv, env={**job_env({**SMALL, **(env or {})}), "BPS_GC_HEARTBEAT_TIMEOUT": "10"},
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, f"{phase}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def parameters(tmp_path, phase, ranks=2):
    return [dict(np.load(tmp_path / f"{phase}-rank{r}.npz")) for r in range(ranks)]


def check_resumed(tmp_path, cases, ranks=2):
    """Every case's parameters, resumed == straight on every rank (and alike on every rank
    where the binding averages every step: CHOCO's nodes hold their own models, and local SGD's
    last step is a local one)."""
    straight, resumed = parameters(tmp_path, "first", ranks), parameters(tmp_path, "second", ranks)
    for rank in range(ranks):
        for key, value in straight[rank].items():
            assert resumed[rank][key].tobytes() == value.tobytes(), f"rank {rank} {key}"
            if cases[key.split("/")[0]]["case"] in ("hook", "optimizer"):
                assert value.tobytes() == straight[0][key].tobytes(), f"rank {rank} {key} differs from rank 0"
    assert {key.split("/")[0] for key in straight[0]} == set(cases)


def same_parameters(a, b, ranks=2, phase="first"):
    """Two launches' parameters, bit for bit on every rank."""
    for rank, (left, right) in enumerate(zip(parameters(a, phase, ranks), parameters(b, phase, ranks))):
        assert left.keys() == right.keys()
        for key, value in left.items():
            assert right[key].tobytes() == value.tobytes(), f"rank {rank} {key}"


def every_compressor(cases):
    """The cases run every compressor bps_gc registers (a new one must join them); codecs that
    other tests register in the same process (plugins) are not bps_gc's."""
    from bps_gc.compress.registry import COMPRESSORS
    ours = {name for name, cls in COMPRESSORS.items() if cls.__module__.startswith("bps_gc.")}
    assert {c["compression_params"]["compressor"] for c in cases.values() if c.get("compression_params")} == ours


# 6 steps, a checkpoint after 3 ("first"); the elastic phase's every 2 steps, rank 1 killed at step 5
SPEC = {"cases": CASES, "steps": 6, "save_at": 3, "every": 2, "kill_rank": 1, "kill_step": 5}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One torchrun --max-restarts 1 launch: the elastic phase first (test_torch_elastic_restart_
    resumes_with_codec_state), whose kill ends the first attempt; the restarted processes resume
    it, then (bps_gc shut down and initialised again in the same processes) run the straight run
    of every case, 6 steps with a checkpoint after 3, on numpy chains, then on the torch codec
    chains, in ``device/``: shared by the tests that resume from it (with and without the codec
    state) and the refusals."""
    out = tmp_path_factory.mktemp("straight")
    run_phase(SPEC, out, "elastic,first,device:first", restarts=1)
    return out


@pytest.fixture(scope="module")
def resumed(straight):
    """One launch (new processes, bpslaunch) resuming ``straight``'s checkpoints in turn: numpy
    chains without the codec state ("without_state": its codecs afresh), with it ("second"), then
    the torch chains with theirs; last, rank 0 alone refuses states that do not fit
    ("state_errors", a 1-rank job: test_states_that_do_not_fit_are_refused_by_name; its stderr in
    resumed-stderr.txt). Each phase gives the same bits as a launch of its own (each is a job of
    its own, init() to shutdown(), whose hooks and optimizers bps_gc names from 0 as a fresh
    process does, so a phase loads what a phase saved wherever each sits)."""
    result = run_phase(SPEC, straight, "without_state,second,device:second,state_errors")
    (straight / "resumed-stderr.txt").write_text(result.stderr)
    return straight


@pytest.mark.parametrize("where", ["", "device"], ids=["numpy_chains", "device_chains"])
def test_resumed_equals_straight(where, resumed):
    check_resumed(resumed / where, CASES)
    if where:  # the torch chains did run there: their random rounding is not numpy's
        numpy, device = parameters(resumed, "first"), parameters(resumed / where, "first")
        for name in ("dithering", "qsgd", "terngrad"):
            assert numpy[0][f"{name}/{name}.0.weight"].tobytes() != device[0][f"{name}/{name}.0.weight"].tobytes(), name


def test_resumed_without_codec_state_differs(resumed):
    """The test above can fail: resuming without the codec state changes the result."""
    first, without = parameters(resumed, "first"), parameters(resumed, "without_state")
    for name in ("topk_ef_hook", "dgc", "choco"):
        assert first[0][f"{name}/{name}.0.weight"].tobytes() != without[0][f"{name}/{name}.0.weight"].tobytes(), name


def test_torch_elastic_restart_resumes_with_codec_state(straight):
    """torchrun --max-restarts 1: rank 1 is killed (SIGKILL) at step 5 of 6 on the first attempt;
    torch elastic restarts both ranks, which resume from the step-4 checkpoint (every 2 steps)
    with their codec state: the final parameters equal a run never killed (``straight``'s first
    phase, run by the restarted processes after this one). So runs repeat too: the first attempt,
    other processes (other process ids) from step 0, trained every codec as the straight run did
    (thc's rounding seeded by the seed, key and rank)."""
    every_compressor(CASES)
    for rank in range(2):  # the first attempt started at 0, the second from the checkpoint
        assert (straight / f"elastic-attempt0-rank{rank}.txt").read_text() == "0"
        assert (straight / f"elastic-attempt1-rank{rank}.txt").read_text() == "4"
    first, elastic = parameters(straight, "first"), parameters(straight, "elastic")
    for rank in range(2):
        for key, value in first[rank].items():
            assert elastic[rank][key].tobytes() == value.tobytes(), f"rank {rank} {key}"


TWO_HOSTS = {"cases": CASES, "steps": 4, "save_at": 2}


def two_hosts_phase(machines, out, phase, launcher):  # noqa: F811
    (out / "spec.json").write_text(json.dumps(TWO_HOSTS))
    job = CollectiveHostsJob(machines, 2, 2, [sys.executable, JOB, str(out / "spec.json"), str(out), phase],
                             launcher, dict(SMALL, BPS_GC_HIERARCHY="host", BPS_GC_HEARTBEAT_TIMEOUT="10"))
    statuses, _ = job.wait_all(180)
    assert set(statuses.values()) == {0}, job.report(statuses)


@pytest.fixture(scope="module")
def two_hosts_straight(machines, tmp_path_factory):  # noqa: F811
    """The 2 x 2 straight run (bpslaunch), checkpoint after 2 steps of 4: both launchers'
    resumed runs start from it and must end on its parameters."""
    out = tmp_path_factory.mktemp("two_hosts")
    two_hosts_phase(machines, out, "first", "bpslaunch")
    return out


@pytest.mark.parametrize("launcher", ["torchrun", "bpslaunch"])
def test_two_hosts_two_levels_resume_bit_for_bit(machines, two_hosts_straight, tmp_path, launcher):  # noqa: F811
    """2 hosts x 2 ranks (network namespaces, one launcher per host), two levels: the owners'
    chains compress the host sums (CHOCO gossips over a ring of the 4 ranks); every case,
    resumed (new processes under ``launcher``) == straight on all 4 ranks. The straight run is
    bpslaunch's for both launchers (a launcher changes no result: on 2 ranks the straight run is
    torchrun's, resumed under bpslaunch), one 4-rank launch fewer."""
    for rank in range(4):
        shutil.copy(two_hosts_straight / f"first-rank{rank}.npz", tmp_path)
        shutil.copy(two_hosts_straight / f"checkpoint-run-rank{rank}.pt", tmp_path)
    two_hosts_phase(machines, tmp_path, "second", launcher)
    check_resumed(tmp_path, TWO_HOSTS["cases"], ranks=4)


def test_parameter_server_optimizer_resumes_bit_for_bit(tmp_path):
    """On the parameter server (one bpslaunch per role: scheduler, a server, 2 workers; every
    process new for each launch), every codec: DistributedOptimizers (onebit + EF + nesterov
    with the servers' recompress reducer, thc's phases, ...), CHOCO (its copies travel worker to
    worker) and local SGD. ``optimizer.state_dict()["bps_gc"]`` and bps_gc.torch.state_dict()
    hold the workers' chains and the servers' state (their EF); the resumed run equals the
    straight one bit for bit, and so does a second launch of the straight one (runs repeat)."""
    import torch
    every_compressor(PS_CASES)
    spec = {"cases": PS_CASES, "steps": 4, "save_at": 2}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "repeat").mkdir()
    for phase, out in (("first", tmp_path), ("second", tmp_path), ("first", tmp_path / "repeat")):
        # a 10 s heartbeat: this checks results, not fault detection (beside other jobs on 2
        # cores the default 2 s one once timed out while the workers imported torch)
        job = Job(2, None, servers=1, env=dict(SMALL, BPS_GC_HEARTBEAT_TIMEOUT="10"),
                  command=[sys.executable, JOB, str(tmp_path / "spec.json"), str(out), phase])
        statuses, _ = job.wait_all(120)
        assert set(statuses.values()) == {0}, job.report(statuses)
    check_resumed(tmp_path, PS_CASES)
    same_parameters(tmp_path, tmp_path / "repeat")
    saved = torch.load(tmp_path / "checkpoint-run-rank0.pt", weights_only=True)
    for state in (saved["bps_gc"], saved["optimizers"]["onebit_ef_nesterov"]["bps_gc"]):
        communicator = state["communicator"]
        assert communicator["meta.transport"] == "ps" and state["world_size"] == 2
        assert any(k.startswith("server/") and "ef.error" in k for k in communicator), sorted(communicator)[:20]
        assert any(k.startswith("worker/") and "momentum" in k for k in communicator), sorted(communicator)[:20]


def test_parameter_server_two_hosts_two_levels_resume_bit_for_bit(machines, tmp_path):  # noqa: F811
    """2 hosts x 2 ranks on the parameter server (network namespaces, one bpslaunch per host and
    role, two levels: each partition's owner keeps its chain, a server on each host), every
    process new for the second phase: the torch bindings' cases resume bit for bit on all 4 ranks."""
    cases = {name: CASES[name] for name in ("onebit_ef_nesterov", "dithering", "dgc", "powersgd", "thc", "choco",
                                            "local_sgd")}
    spec = {"cases": cases, "steps": 4, "save_at": 2}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    for phase in ("first", "second"):
        # a 10 s heartbeat: this checks results, not fault detection (beside the rest of the
        # suite a 2 s one once timed out on every process at the same moment)
        job = HostsJob(machines, 2, [2, 2], 2, [sys.executable, JOB, str(tmp_path / "spec.json"), str(tmp_path), phase],
                       env=dict(SMALL, BPS_GC_HIERARCHY="host", BPS_GC_HEARTBEAT_TIMEOUT="10"))
        statuses, _ = job.wait_all(180)
        assert set(statuses.values()) == {0}, job.report(statuses)
    check_resumed(tmp_path, cases, ranks=4)


def test_states_that_do_not_fit_are_refused_by_name(resumed):
    """Another world size (refused naming both sizes; dropped with one warning line when asked),
    a parameter the model lacks, another codec setting, a bad array, not a state at all: a clear
    error, and the communicator's state is unchanged after each refusal. A 1-rank job
    (tests/state_errors.py) at the end of ``resumed``'s launch, loading ``straight``'s 2-rank
    checkpoint; the launch's other phases load only states that fit."""
    got = json.loads((resumed / "errors.json").read_text())
    assert "parameters this model does not have: 'encoder.weight'" in got["unknown parameter"]
    assert "another codec setting" in got["another setting"] and "'k' is 0.5 in the state, 0.2 here" in got["another setting"]
    assert "ef.error" in got["bad communicator array"] and "shape" in got["bad communicator array"]
    assert "not a bps_gc.torch state" in got["not a state"]
    assert got["map_location"] == "loaded: True"
    assert "world size 2 in the state, 1 here" in got["world size"]
    assert "BPS_GC_RESUME_DROP_RANK_STATE=1" in got["world size"]
    assert got["world size dropped"] == "loaded: False"
    assert all(value for key, value in got.items() if key.endswith("unchanged"))
    stderr = (resumed / "resumed-stderr.txt").read_text()
    warnings = [line for line in stderr.splitlines() if "dropping the saved codec state" in line]
    assert len(warnings) == 1 and "world size 2 in the state, 1 here" in warnings[0]


def test_truncated_or_corrupt_checkpoint_is_named(tmp_path):
    import torch

    from bps_gc.compress.stateful import StateError
    from bps_gc.torch import load_checkpoint, save_checkpoint
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"bps_gc": {"format": "x", "t": torch.arange(1000.0)}}, str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left
    assert load_checkpoint(str(path))["bps_gc"]["t"].sum() == 499500
    data = path.read_bytes()
    for cut in (len(data) // 2, 10):
        path.write_bytes(data[:cut])
        with pytest.raises(StateError, match="truncated or corrupt"):
            load_checkpoint(str(path))
    path.write_bytes(data[:100] + bytes(len(data) - 100))
    with pytest.raises(StateError, match="truncated or corrupt"):
        load_checkpoint(str(path))
