"""CHOCO-SGD and D-PSGD on real processes: the neighbours' messages go worker to worker, through
bps_gc's parameter-server runtime (one bpslaunch per role, as on separate hosts) or its
torch.distributed transport (gloo isend/irecv; bpslaunch --local --servers 0, the transport
torchrun gives, without torchrun's agent: ~0.9 s of CPU a launch), both via
bps_gc.core.send/recv; the models follow the numpy oracle of spec §5 (test_choco_math.oracle_choco)
and are the same over both; the averaged model is the mean of the nodes'; a killed neighbour
stops the others naming it (the run on bps_gc's runtime ends so: its results saved, it trains on
until a worker is killed)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bps_gc.algorithms.topology import topology
from collective_cluster import bpslaunch_argv
from conftest import LAUNCH_PYTHONPATH, ROOT
from multihost import INTERVAL, Job
from test_choco_math import oracle_choco

pytest.importorskip("torch")
TRANSPORTS = ["bps_gc", "gloo"]
JOB = os.path.join(ROOT, "tests", "choco_job.py")
STEPS = 12


def run_jobs(jobs, tmp_path):
    """The jobs ({"configs", "out", "workers"}) over torch.distributed, one after the other in one
    launch (bpslaunch --servers 0) of as many processes as the largest job: choco_job.py's "jobs"."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    env = dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH, OMP_NUM_THREADS="1")
    argv = bpslaunch_argv([JOB, str(spec), str(tmp_path), "gloo"], max(job["workers"] for job in jobs))
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)


def flat(run_, cfg, key):
    names = sorted(k for k in run_ if k.startswith(f"{cfg}/init/"))
    return np.concatenate([run_[n.replace("/init/", f"/{key}/")].ravel() for n in names])


def configs(graph, gamma=0.3, lr=0.05, params=None, prefix=""):
    return [{"name": prefix + "choco", "algorithm": "choco", "graph": graph, "gamma": gamma, "lr": lr,
             "steps": STEPS, "params": params or {"compressor": "topk", "k": 2}},
            {"name": prefix + "dpsgd", "algorithm": "dpsgd", "graph": graph, "steps": 4, "lr": lr, "zero_grads": True}]


# the graphs of 4 workers share one launch per transport, each graph's configs under its prefix
# (every config seeds its own model and gradients: the same numbers as a launch of its own)
FOUR_WORKER_GRAPHS = {"ring": "", "0-1,1-2,2-0,2-3": "kite_"}
# the torus of 9 runs once (9 processes on a small CI box): over torch.distributed, in the launch
# of the 4-worker graphs' gloo runs (gloo_runs), whose processes start once
CASES = [(t, g, 4) for t in TRANSPORTS for g in FOUR_WORKER_GRAPHS] + [("gloo", "torus", 9)]


class KilledRun:
    """The 4-worker configs on bps_gc's runtime, one bpslaunch per role (tests/multihost.py), then
    worker 2 killed while the workers train a CHOCO ring on (spec "until_killed"): the
    configs' results, and how the job ended (what the dead-neighbour test checks)."""

    HEARTBEAT = 5.0

    def __init__(self, configs, out):
        spec = out / "spec.json"
        spec.write_text(json.dumps({"configs": configs, "until_killed": True}))
        # a 5 s heartbeat rather than the fault tests' 2 s: the job trains every config first, and
        # on a busy 2-core box four workers importing torch at once once starved a 3 s one
        self.job = Job(4, None, command=[sys.executable, JOB, str(spec), str(out)],
                       env={"BPS_GC_HEARTBEAT_TIMEOUT": str(self.HEARTBEAT)})
        self.statuses, self.error = None, None
        try:
            self.job.wait_output([f"worker{w}" for w in range(4)], "RUNNING", 180)
            os.kill(self.job.child_of("worker2"), signal.SIGKILL)
            # the heartbeats end it a few seconds after their timeout (about 1-2.5 s after, with 2 s); the
            # slack is for the suite's other pytest process, whose clusters start beside this one
            # (without the heartbeats the job would wait for the 300 s join timeout)
            self.statuses, _ = self.job.wait_all(self.HEARTBEAT + 2 * INTERVAL + 10.0, since=time.monotonic())
        except AssertionError as e:  # the dead-neighbour test reports it; the saved results stand
            self.error = str(e)
        finally:
            self.job.kill_all()

    def check_saved(self):
        """Each worker saved its results (printed SAVED) with no error before."""
        for w in range(4):
            text = self.job.text(f"worker{w}")
            assert "SAVED" in text and "Traceback" not in text.split("SAVED")[0], self.job.report(self.statuses)


def check_ended_well(result):
    if isinstance(result, KilledRun):
        result.check_saved()
    else:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """One launch of 9 processes over torch.distributed: the torus of 9 on all of them, then
    every 4-worker graph on ranks 0-3 (a job and process group of their own: choco_job.py's
    "jobs"). {"torus": (result, its folder), "four": (result, its folder)}."""
    folders = {job: tmp_path_factory.mktemp(f"gloo-{job}") for job in ("torus", "four")}
    every = [cfg for graph, prefix in FOUR_WORKER_GRAPHS.items() for cfg in configs(graph, prefix=prefix)]
    result = run_jobs([{"configs": configs("torus"), "out": str(folders["torus"]), "workers": 9},
                       {"configs": every, "out": str(folders["four"]), "workers": 4}], tmp_path_factory.mktemp("gloo"))
    return {job: (result, folder) for job, folder in folders.items()}


@pytest.fixture(scope="module")
def four_worker_runs(gloo_runs, tmp_path_factory):
    """Every 4-worker graph on each transport, in one launch per transport (gloo's shared with the
    torus): the oracle checks, the comparison of the two transports and (bps_gc's, ended by a
    kill) the dead-neighbour test use the same runs."""
    every = [cfg for graph, prefix in FOUR_WORKER_GRAPHS.items() for cfg in configs(graph, prefix=prefix)]
    out = tmp_path_factory.mktemp("four-bps_gc")
    return {"bps_gc": (KilledRun(every, out), out), "gloo": gloo_runs["four"]}


@pytest.mark.parametrize("transport,graph,workers", CASES)
def test_choco_on_processes_matches_the_oracle(graph, workers, transport, request):
    params, gamma, lr = {"compressor": "topk", "k": 2}, 0.3, 0.05
    prefix = FOUR_WORKER_GRAPHS.get(graph, "")
    # configs()'s defaults are these parameters
    if workers == 4:
        result, folder = request.getfixturevalue("four_worker_runs")[transport]
    else:  # the torus: gloo
        result, folder = request.getfixturevalue("gloo_runs")["torus"]
    check_ended_well(result)
    runs = [dict(np.load(folder / f"choco{r}.npz")) for r in range(workers)]
    x0 = np.stack([flat(r, prefix + "choco", "init") for r in runs])
    grads = np.stack([np.stack([flat(r, prefix + "choco", f"{t}/grad") for r in runs]) for t in range(STEPS)])
    w = topology(graph, workers).weights
    want = oracle_choco(x0, w, gamma, params, lambda t: np.float32(lr) * grads[t], STEPS,
                        [slice(0, 6), slice(6, 30)])  # bias, weight: each tensor compressed alone
    for t in range(STEPS):
        got = np.stack([flat(r, prefix + "choco", f"{t}/param") for r in runs])
        assert np.allclose(got, want[t], atol=2e-5), (t, np.abs(got - want[t]).max())
    average = flat(runs[0], prefix + "choco", "average")
    assert np.allclose(average, want[-1].mean(0), atol=1e-6)
    # D-PSGD with zero gradients: x <- W x each round
    x = np.stack([flat(r, prefix + "dpsgd", "init") for r in runs]).astype(np.float64)
    for t in range(4):
        x = w @ x
        assert np.allclose(np.stack([flat(r, prefix + "dpsgd", f"{t}/param") for r in runs]), x, atol=1e-6)


def test_bps_gc_and_gloo_give_the_same_models(four_worker_runs):
    models = {}
    for transport, (result, out) in four_worker_runs.items():
        check_ended_well(result)
        models[transport] = [dict(np.load(out / f"choco{r}.npz")) for r in range(4)]
    for r in range(4):
        for key, value in models["bps_gc"][r].items():
            if "/param/" in key:
                assert np.array_equal(value, models["gloo"][r][key]), (r, key)


def test_a_dead_neighbour_stops_the_job_naming_it(four_worker_runs):
    # one bpslaunch per role, as on separate hosts: the heartbeats find the dead worker, not a
    # shared launcher tearing the job down
    killed = four_worker_runs["bps_gc"][0]
    report = killed.job.report(killed.statuses)
    assert killed.error is None, killed.error
    assert all(status != 0 for status in killed.statuses.values()), report
    for w in (1, 3):  # its neighbours, blocked on its messages
        assert "NodeFailure" in killed.job.text(f"worker{w}") and "worker 2" in killed.job.text(f"worker{w}"), report
