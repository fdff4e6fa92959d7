"""torch.distributed with several ranks per host (BPS_GC_HIERARCHY=host, the default): 2 hosts
(network namespaces) x 3 local ranks, started per host by bpslaunch (DMLC_NUM_SERVER=0,
NVIDIA_VISIBLE_DEVICES=0,1,2) or by torchrun (--nnodes 2 --nproc-per-node 3, static rendezvous
at host 0). Dense, onebit + EF, topk, majority, fp16 (dense and topk) pull, bit for bit, what local_ranks.py's HostModel
says the parameter server's two levels pull (each host's sum compressed once by its owner, the
server's reducer over one payload per host); PowerSGD, whose ranks each compress their own
gradient and whose phases are two-level sums, matches its numpy model to float rounding; the
torchrun launch's ranks also run all_reduce_cuda's three steps (NCCL's) on a CPU tensor. A local
rank killed (-9), raising, interrupted or exiting mid-job stops both hosts' launchers in bounded
time, host 0's ranks naming it (the bpslaunch launch of the results is the first phase of the
exiting rank's job: one launch fewer)."""
import json
import math
import os
import sys
import textwrap
import time

import numpy as np
import pytest

from bps_gc.collective.levels import host_layout
from collective_hosts import TESTS, CollectiveHostsJob, powersgd_expected, run_spec
from collective_levels_job import HOOK_INDEX, HOOK_LR, HOOK_MODES, HOOK_STEPS, HOOK_TENSORS
from local_ranks import HostModel, expected_results, machines  # noqa: F401
from multihost import processes_with
from reference import gradient, step_ctx

HOSTS, LOCAL = 2, 3
SPEC = {"steps": 2, "lrs": [0.1, 0.05], "partition_bytes": 2048, "min_compress_bytes": 0,
        "tensors": [
            {"name": "dense", "shape": [1100], "dtype": "float32", "params": {}},
            {"name": "onebit-ef", "shape": [1100], "dtype": "float32",
             "params": {"compressor": "onebit", "scaling": True, "ef": "vanilla"}},
            {"name": "topk", "shape": [1100], "dtype": "float32",
             "params": {"compressor": "topk", "k": 0.05, "ef": "vanilla"}, "reducer": "recompress"},
            {"name": "majority", "shape": [1100], "dtype": "float32",
             "params": {"compressor": "onebit", "scaling": True}, "reducer": "majority"},
            {"name": "fp16", "shape": [1100], "dtype": "float32", "params": {"fp16": True}},
            {"name": "topk-fp16", "shape": [1100], "dtype": "float32",
             "params": {"compressor": "topk", "k": 0.05, "fp16": True}},
            {"name": "sum", "shape": [7, 3], "dtype": "float32", "average": False, "params": {}}]}
POWERSGD = {"name": "powersgd", "shape": [24, 16], "dtype": "float32", "params": {"compressor": "powersgd", "rank": 2}}
BOUND = 15.0  # seconds from the kill to the last launcher gone (heartbeat timeout: 2 s)


@pytest.fixture(scope="module")
def torchrun_levels(machines, tmp_path_factory):  # noqa: F811
    """The torchrun launch (its folder, its ranks' results), shared by the tests that read it:
    one launch's processes (2 agents, 6 ranks) started once. Its ranks first run the pieces a
    DDP hook calls (collective_levels_job.py), then cluster_job.py."""
    folder = tmp_path_factory.mktemp("torchrun-levels")
    spec = dict(SPEC, tensors=SPEC["tensors"] + [POWERSGD])
    return folder, run_spec(machines, spec, folder, HOSTS, LOCAL, "torchrun", script="collective_levels_job.py")


@pytest.fixture(scope="module")
def exit_fault_after_levels(machines, tmp_path_factory):  # noqa: F811
    """The "exit" fault's job, whose ranks first run cluster_job.py with SPEC and PowerSGD into
    the folder: (the folder, what the fault test checks)."""
    folder = tmp_path_factory.mktemp("bpslaunch-levels")
    return folder, fault_job(machines, "exit", folder)


@pytest.mark.parametrize("launcher", ["bpslaunch", "torchrun"])
def test_two_levels_give_the_parameter_servers_two_level_results(launcher, request):
    """Under bpslaunch, the first phase of test_a_local_rank_that_ends_stops_every_host's "exit"
    job (its ranks run cluster_job.py, then the training that rank 4 leaves): one launch."""
    spec = dict(SPEC, tensors=SPEC["tensors"] + [POWERSGD])
    if launcher == "torchrun":
        tmp_path, got = request.getfixturevalue("torchrun_levels")
        check_hook_levels(spec, tmp_path)
    else:
        tmp_path, _ = request.getfixturevalue("exit_fault_after_levels")
        got = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(HOSTS * LOCAL)]
    expected = expected_results(SPEC, HOSTS, LOCAL)
    powersgd = powersgd_expected(spec, POWERSGD, len(SPEC["tensors"]), HOSTS * LOCAL)
    for rank in range(HOSTS * LOCAL):
        for key, value in expected.items():
            assert got[rank][key].tobytes() == value.tobytes(), \
                f"{launcher} rank {rank} {key}: max diff {np.abs(got[rank][key] - value).max()}"
        for key, value in powersgd.items():
            np.testing.assert_allclose(got[rank][key], value, rtol=1e-4, atol=1e-5, err_msg=f"rank {rank} {key}")
            assert got[rank][key].tobytes() == got[0][key].tobytes()
    # the host level changes what a codec sees: onebit of a host's sum is not the mean of signs
    assert len(np.unique(np.abs(got[0]["onebit-ef/0"]))) <= 2 * HOSTS


def check_hook_levels(spec, tmp_path):
    """collective_levels_job.py's results: what the parameter server's two levels give for the
    same gradients (each a tensor of its own key), summed, not averaged."""
    models = [HostModel(t["params"], t["shape"], t["dtype"], HOOK_INDEX + position - 1, HOSTS, LOCAL,
                        spec["partition_bytes"], spec["min_compress_bytes"], average=False)
              for position, t in enumerate(HOOK_TENSORS)]
    expected = [model.step([gradient(r, 0, t) for r in range(HOSTS * LOCAL)], step_ctx(spec, 0))
                for model, t in zip(models, HOOK_TENSORS)]
    for rank in range(HOSTS * LOCAL):
        got = np.load(tmp_path / f"levels{rank}.npz")
        assert got["hook-dense"].tobytes() == expected[0].tobytes(), f"rank {rank}: reduce_tensor"
        coded = np.concatenate([e.reshape(-1) for e in expected[1:]])
        assert got["coded"].tobytes() == coded.tobytes(), f"rank {rank}: reduce_coded_on_hosts"
    check_ddp_hook([np.load(tmp_path / f"levels{rank}.npz") for rank in range(HOSTS * LOCAL)])


class HostThc:
    """What the hook's thc gives for one gradient under two levels (collective/exchange/phased.py): each host's
    float32 sum in local-rank order plus that host's residual, 4-bit codes to the nearest (ties
    up) against the shared exponent, summed over the hosts as int64, decoded and averaged."""

    def __init__(self, params, n):
        self.levels = 2 ** params["bits"] - 1
        self.errors = np.zeros((HOSTS, n), np.float32)

    def step(self, inputs, ctx):
        sums = []
        for h in range(HOSTS):
            total = inputs[h * LOCAL].astype(np.float32).copy()
            for x in inputs[h * LOCAL + 1:(h + 1) * LOCAL]:
                total += x
            sums.append(total)
        ys = np.array(sums, np.float32) + self.errors
        exponent = max(math.ceil(math.log2(float(np.abs(y).max()))) for y in ys)
        codes = np.clip(np.floor((ys.astype(np.float64) / 2.0**exponent + 1) * self.levels / 2 + 0.5), 0,
                        self.levels).astype(np.int64)
        self.errors = ys - (2.0**exponent * (2.0 * codes / self.levels - 1)).astype(np.float32)
        total = codes.sum(axis=0)
        return (2.0**exponent * (2.0 * total / self.levels - HOSTS)).astype(np.float32) / np.float32(HOSTS * LOCAL)


def check_ddp_hook(runs):
    """The DDP hook's buckets under two levels (every rank's gradients in, averaged bucket out,
    in call order): each gradient of a bucket is HostModel's tensor of its own, its state kept
    per parameter when DDP regroups the buckets (the hook's rule: one owner and chain per
    gradient), its step counted per parameter. Topk and error feedback draw nothing random, so
    the codecs' keys need not be the hook's."""
    for mode, params in HOOK_MODES.items():
        calls = sum(1 for name in runs[0].files if name.startswith(f"{mode}/index"))
        state, carried = {}, 0
        for k in range(calls):
            index, sizes = int(runs[0][f"{mode}/index{k}"]), [int(n) for n in runs[0][f"{mode}/sizes{k}"]]
            owners = [int(p) for p in runs[0][f"{mode}/params{k}"]]
            assert all(int(run[f"{mode}/index{k}"]) == index for run in runs), f"{mode} call {k}: bucket order"
            for n, owner in zip(sizes, owners):
                state.setdefault(owner, [HostThc(params, n) if params.get("compressor") == "thc" else
                                         HostModel(params, [n], "float32", HOOK_INDEX, HOSTS, LOCAL, 1 << 30, 0), 0])
            step = max(state[owner][1] for owner in owners)
            ctx = {"lr": HOOK_LR, "step": step}
            carried += step > 0  # error feedback's state carried from an earlier step
            for owner in owners:
                state[owner][1] = step + 1
            bounds = np.cumsum([0] + sizes)
            inputs = [run[f"{mode}/in{k}"] for run in runs]
            expected = np.concatenate([state[owner][0].step([x[bounds[i]:bounds[i + 1]] for x in inputs], ctx)
                                       for i, owner in enumerate(owners)])
            for rank, run in enumerate(runs):
                got = run[f"{mode}/out{k}"]
                assert got.tobytes() == expected.tobytes(), \
                    f"{mode} rank {rank} call {k} (bucket {index}): max diff {np.abs(got - expected).max()}"
        assert calls >= HOOK_STEPS + 1 and carried, f"{mode}: {calls} buckets, {carried} with earlier state"


TRAIN = textwrap.dedent("""
    import os, runpy, signal, sys, numpy as np, bps_gc.core as bps
    if "LEVELS_SPEC" in os.environ:  # first cluster_job.py, on the same init (it would shut bps_gc down)
        shutdown, bps.shutdown = bps.shutdown, lambda: None
        sys.argv = [os.environ["LEVELS_JOB"], os.environ["LEVELS_SPEC"], os.environ["LEVELS_OUT"]]
        runpy.run_path(sys.argv[0], run_name="__main__")
        bps.shutdown = shutdown
    bps.init()
    rank = bps.rank()
    bps.declare("grad", shape=(3000,), dtype=np.float32)
    bps.declare("code", shape=(3000,), dtype=np.float32, compressor="onebit", ef="vanilla")
    for step in range(1000000):
        bps.push_pull(np.ones(3000, np.float32), "grad", average=False).wait()
        bps.push_pull(np.ones(3000, np.float32), "code", lr=0.1).wait()
        if step == 3:
            print("RUNNING", rank, flush=True)
        if step == 5 and rank == int(os.environ["KILLED_RANK"]):
            fault = os.environ["FAULT"]
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "sigint":  # Ctrl-C
                os.kill(os.getpid(), signal.SIGINT)
            elif fault == "raise":
                raise RuntimeError("a bug in the training loop")
            else:  # a clean exit in the middle of the job
                sys.exit(0)
""")


def memfds(port):
    """memfd arenas (wire/shm.py) held by processes of the job on ``port``: the kernel frees
    each with its last holder, so none may remain once the job's processes are gone; and nothing
    of ours is ever made in /dev/shm."""
    found = [name for name in os.listdir("/dev/shm") if "bps_gc" in name]
    for pid in processes_with(f"DMLC_PS_ROOT_PORT={port}"):
        try:
            found += [pid for fd in os.listdir(f"/proc/{pid}/fd")
                      if "memfd:bps_gc" in os.readlink(f"/proc/{pid}/fd/{fd}")]
        except OSError:
            continue
    return found


def fault_job(machines, fault, levels_folder=None):  # noqa: F811
    """TRAIN on 2 hosts x 3 ranks, rank 4 doing ``fault`` at its step 5; with ``levels_folder``,
    the ranks first run cluster_job.py with SPEC and PowerSGD there (its partition size then).
    What the fault test checks, once the launchers are gone."""
    env = {"BYTEPS_PARTITION_BYTES": "4096", "BYTEPS_MIN_COMPRESS_BYTES": "0", "KILLED_RANK": "4", "FAULT": fault}
    if levels_folder is not None:
        spec = dict(SPEC, tensors=SPEC["tensors"] + [POWERSGD])
        (levels_folder / "spec.json").write_text(json.dumps(spec))
        env.update(BYTEPS_PARTITION_BYTES=str(spec["partition_bytes"]), LEVELS_OUT=str(levels_folder),
                   LEVELS_SPEC=str(levels_folder / "spec.json"), LEVELS_JOB=os.path.join(TESTS, "cluster_job.py"))
    job = CollectiveHostsJob(machines, HOSTS, LOCAL, [sys.executable, "-c", TRAIN], env=env)
    try:
        job.wait_output(["worker0", "worker1"], "RUNNING", 90)
        faulted_at = time.monotonic()
        statuses, elapsed = job.wait_all(BOUND, since=faulted_at)
    finally:
        job.kill_all()
    return {"statuses": statuses, "elapsed": elapsed, "report": job.report(statuses),
            "survivors": job.text("worker0"), "memfds": memfds(job.port)}


@pytest.mark.parametrize("fault", ["kill", "raise", "sigint", "exit"])
def test_a_local_rank_that_ends_stops_every_host(machines, fault, request):  # noqa: F811
    """Rank 4 (host 1's middle rank) is killed -9, raises, gets Ctrl-C or exits cleanly mid-job
    (the "exit" job's ranks first run test_two_levels' bpslaunch case: exit_fault_after_levels)."""
    run = request.getfixturevalue("exit_fault_after_levels")[1] if fault == "exit" else fault_job(machines, fault)
    report = run["report"]
    assert all(status != 0 for status in run["statuses"].values()), report
    failures = [line for line in run["survivors"].splitlines() if "NodeFailure" in line]
    assert len(failures) == LOCAL and all("rank 4" in line for line in failures), report
    assert "Traceback" not in run["survivors"], report
    assert not run["memfds"]
    print(f"collective, local rank {fault}: every launcher exited {run['elapsed']:.2f} s after the fault; "
          f"{failures[0]}", file=sys.stderr)


def test_host_layout_decides_alike_on_every_rank():
    two_hosts = [(h, i, 3) for h in (7, 9) for i in range(3)]  # (host key, local rank, local size)
    assert host_layout(two_hosts, "auto") == (3, None)
    assert host_layout(two_hosts, "flat")[0] is None
    assert host_layout(two_hosts[:3], "auto")[0] is None  # one host: flat unless asked
    assert host_layout(two_hosts[:3], "host") == (3, None)
    size, problem = host_layout([(0, 0, 2), (0, 1, 2), (1, 0, 1)], "auto")
    assert size is None and "different numbers of local ranks" in problem
    size, problem = host_layout([(1, 0, 2), (1, 1, 2), (0, 0, 2), (0, 1, 2)], "host")
    assert size is None and "rank 0 is local rank 0 of host 1" in problem


@pytest.mark.parametrize("local_size", [2, 3, 4])
def test_dense_stripes_cover_the_buffer_and_copy_out_divides(local_size):
    """The dense pipeline's layout: every element in one share of one stripe, shares at most
    PIPELINE_BYTES, padding under one element per share; _copy_out puts each piece of the joined
    buffer into the outs it overlaps, divided where asked (numpy slicing is the oracle)."""
    import types
    from bps_gc.collective import levels
    host = types.SimpleNamespace(local_size=local_size)
    for n in (1, 5, 1000, levels.PIPELINE_BYTES // 4 * local_size, levels.PIPELINE_BYTES // 4 * local_size + 1,
              6_400_000):
        share, count = levels.HostLevels.stripes(host, n, 4)
        assert count * local_size * share >= n > (count * local_size) * (share - 1)
        assert count == 1 or share * 4 <= levels.PIPELINE_BYTES
    rng = np.random.default_rng(local_size)
    share, count, n = 7, 3, 41  # 3 stripes of L shares of 7 (42 to 84 elements), outs of 41 in all
    padded = count * local_size * share
    results = [rng.standard_normal(padded).astype(np.float32) for _ in range(local_size)]
    sizes = [7, 1, 20, 13]
    outs = [(np.zeros(s, np.float32), None if k % 2 else np.float32(3)) for k, s in enumerate(sizes)]
    pieces = [(k * local_size * share + i * share, k * local_size * share + (i + 1) * share, i)
              for k in range(count) for i in range(local_size)]
    levels.HostLevels._copy_out(results, pieces, outs)
    joined = np.empty(padded, np.float32)
    for start, stop, owner in pieces:
        joined[start:stop] = results[owner][start:stop]
    offset = 0
    for dest, divisor in outs:
        expected = joined[offset:offset + dest.size]
        if divisor is not None:
            expected = expected / divisor
        assert dest.tobytes() == expected.astype(np.float32).tobytes()
        offset += dest.size
    assert offset == n


def test_the_nccl_paths_steps_on_cpu_tensors(torchrun_levels):
    """all_reduce_cuda's three steps (reduce_scatter on the host, all_reduce of the share across
    hosts, all_gather on the host) with gloo on CPU tensors of 7 floats (3 shares of 3, padded),
    on the torchrun launch's 2 hosts x 3 ranks (collective_levels_job.py, each host a network
    namespace): every rank ends with the sum (small integers: exact), as numpy adds it."""
    folder, _ = torchrun_levels
    size = HOSTS * LOCAL
    expected = sum(np.arange(7, dtype=np.float32) * (r + 1) for r in range(size))
    for rank in range(size):
        got = np.load(folder / f"levels{rank}.npz")["nccl-path"]
        assert got.tobytes() == expected.tobytes(), f"rank {rank}: {got} != {expected}"
