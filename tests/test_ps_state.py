"""Checkpoint and restart on the parameter server, bit for bit (issue 33): N steps straight equal
N/2 steps, a checkpoint, every process of the job killed (scheduler, servers, workers), the same
launch commands again, N/2 more. One bpslaunch per role (tests/multihost.py), and 2 hosts x 2
ranks with the two levels (tests/local_ranks.py). The job is tests/state_job.py."""
import json
import os
import sys
import time

import numpy as np

from conftest import ROOT
from local_ranks import HostModel, HostsJob, machines  # noqa: F401
from multihost import Job
from reference import PushPullModel, gradient, step_ctx

JOB = os.path.join(ROOT, "tests", "state_job.py")
STEPS = 6
PARTITION_BYTES = 4096  # 1024 float32 per partition: the larger tensors have several
CODECS = {
    "dense": {},
    "onebit_ef_nesterov": {"compressor": "onebit", "scaling": True, "ef": "vanilla",
                           "momentum": "nesterov", "mu": 0.9},
    "topk_ef": {"compressor": "topk", "k": 0.05, "ef": "vanilla"},
    "randomk": {"compressor": "randomk", "k": 0.05},
    "dithering": {"compressor": "dithering", "k": 2},
    "dgc": {"compressor": "dgc", "k": 0.1, "mu": 0.9},
    "powersgd": {"compressor": "powersgd", "rank": 2},
}
SHAPES = {"powersgd": [40, 60]}
ENV = {"BYTEPS_PARTITION_BYTES": str(PARTITION_BYTES), "BYTEPS_MIN_COMPRESS_BYTES": "0",
       "BPS_GC_DENSE_PARTITION_BYTES": str(PARTITION_BYTES)}


def make_spec(**extra):
    tensors = [{"name": f"{codec}.w", "shape": SHAPES.get(codec, [2500]), "dtype": "float32",
                "params": params} for codec, params in CODECS.items()]
    return {"steps": STEPS, "lrs": [0.1, 0.1, 0.05, 0.05, 0.02, 0.02], "tensors": tensors, **extra}


def finals(out, ranks):
    return [dict(np.load(out / f"final{r}.npz")) for r in range(ranks)]


def assert_same(got, want, what):
    for rank, (g, w) in enumerate(zip(got, want)):
        for name in w:
            assert g[name].tobytes() == w[name].tobytes(), \
                f"{what}: rank {rank} {name}: max diff {np.abs(g[name] - w[name]).max()}"


def numpy_training(spec, hosts, local_size, names):
    """The straight run's parameters recomputed in numpy, for the tensors ``PushPullModel``
    (one rank per host) or ``HostModel`` (two levels) models."""
    out = {}
    for index, t in enumerate(spec["tensors"]):
        if t["name"] not in names:
            continue
        model = PushPullModel(t["params"], t["shape"], t["dtype"], index, hosts, PARTITION_BYTES, 0) \
            if local_size == 1 else \
            HostModel(t["params"], t["shape"], t["dtype"], index, hosts, local_size, PARTITION_BYTES, 0)
        w = np.zeros(t["shape"], t["dtype"])
        for step in range(spec["steps"]):
            ctx = step_ctx(spec, step)
            inputs = [gradient(r, step, t) + w * 0.5 for r in range(hosts * local_size)]
            w = w - np.float32(ctx["lr"]) * model.step(inputs, ctx)
        out[t["name"]] = w
    return out


def run(start_job, spec, out, ranks, kill_after_save=False, bound=120):
    (out / "spec.json").write_text(json.dumps(spec))
    job = start_job([sys.executable, JOB, str(out / "spec.json"), str(out)])
    if kill_after_save:
        deadline = time.monotonic() + bound
        while not all((out / f"ckpt{r}.bin").exists() for r in range(ranks)):
            assert time.monotonic() < deadline, job.report()
            time.sleep(0.1)
        time.sleep(0.3)  # past the rename: every rank now sleeps until killed
        for proc in job.launchers.values():  # kill -9 every launcher; their children die with them
            proc.kill()
        statuses, _ = job.wait_all(10)  # asserts nothing of the job is left
        return job
    statuses, _ = job.wait_all(bound)
    assert set(statuses.values()) == {0}, job.report(statuses)
    return job


def restart_matches_straight(start_job, tmp_path, hosts, local_size):
    ranks = hosts * local_size
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    run(start_job, make_spec(), straight, ranks)
    # rank 0 restores the servers' state a second after the others push their first round
    spec = make_spec(save_at=STEPS // 2 - 1, hang_after_save=True, load_delay={"0": 1.0})
    run(start_job, spec, resumed, ranks, kill_after_save=True)
    assert not list(resumed.glob("final*.npz"))
    job = run(start_job, spec, resumed, ranks)  # the same command: it finds its checkpoint
    assert all(f"resumed at step {STEPS // 2}" in job.text(n) for n in job.launchers if n.startswith("worker"))
    want = finals(straight, ranks)
    assert_same(finals(resumed, ranks), want, "resumed vs straight")
    assert_same(want[1:], want[:1] * (ranks - 1), "ranks differ")
    names = {f"{c}.w" for c in ("dense", "onebit_ef_nesterov", "topk_ef", "randomk", "dithering")}
    assert_same(want[:1], [numpy_training(make_spec(), hosts, local_size, names)], "straight vs numpy")


def test_restart_bit_for_bit_multihost(tmp_path):
    """2 workers, 2 servers, one bpslaunch per role; the numpy re-computation checks the run."""
    restart_matches_straight(lambda cmd: Job(2, None, servers=2, env=ENV, command=cmd), tmp_path, 2, 1)


def test_restart_bit_for_bit_two_levels(machines, tmp_path):  # noqa: F811
    """2 hosts x 2 ranks, the two levels (each partition's owner keeps its chain), 2 servers;
    the numpy model of two levels checks the run."""
    restart_matches_straight(lambda cmd: HostsJob(machines, 2, [2, 2], 2, cmd, env=ENV),
                             tmp_path, 2, 2)


def test_resume_with_another_server_count(tmp_path):
    """Saved with 2 servers, resumed with 1 (each key's state goes to its server now): the
    parameters of a straight run on 2 servers, bit for bit."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    job = lambda servers: lambda cmd: Job(2, None, servers=servers, env=ENV, command=cmd)  # noqa: E731
    run(job(2), make_spec(), straight, 2)
    spec = make_spec(save_at=STEPS // 2 - 1, hang_after_save=True)
    run(job(2), spec, resumed, 2, kill_after_save=True)
    run(job(1), spec, resumed, 2)
    assert_same(finals(resumed, 2), finals(straight, 2), "resumed on 1 server vs straight on 2")
