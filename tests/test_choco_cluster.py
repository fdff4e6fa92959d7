"""CHOCO-SGD and D-PSGD on real processes (bpslaunch --local): the neighbours' messages go
worker to worker (bps_gc.core.send/recv), the models follow the numpy oracle of spec §5
(test_choco_math.oracle_choco), the averaged model is the mean of the nodes', a killed
neighbour stops the others naming it."""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from bps_gc.bindings.topology import topology
from cluster import run_local
from conftest import ROOT
from test_choco_math import oracle_choco

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("bps_gc.roles.peers") is None,
                                reason="worker-to-worker send/recv (roles.peers) is not in this tree yet")
STEPS = 12


def run(configs, tmp_path, workers, env=None):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"configs": configs}))
    return run_local([sys.executable, os.path.join(ROOT, "tests", "choco_job.py"), str(spec), str(tmp_path)],
                     workers=workers, servers=1, timeout=240, env=env)


def flat(run_, cfg, key):
    names = sorted(k for k in run_ if k.startswith(f"{cfg}/init/"))
    return np.concatenate([run_[n.replace("/init/", f"/{key}/")].ravel() for n in names])


@pytest.mark.parametrize("graph,workers", [("ring", 4), ("0-1,1-2,2-0,2-3", 4)])
def test_choco_on_processes_matches_the_oracle(graph, workers, tmp_path):
    params, gamma, lr = {"compressor": "topk", "k": 2}, 0.3, 0.05
    configs = [{"name": "choco", "algorithm": "choco", "graph": graph, "gamma": gamma, "params": params,
                "steps": STEPS, "lr": lr},
               {"name": "dpsgd", "algorithm": "dpsgd", "graph": graph, "steps": 4, "lr": lr, "zero_grads": True}]
    result = run(configs, tmp_path, workers)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    runs = [dict(np.load(tmp_path / f"choco{r}.npz")) for r in range(workers)]
    x0 = np.stack([flat(r, "choco", "init") for r in runs])
    grads = np.stack([np.stack([flat(r, "choco", f"{t}/grad") for r in runs]) for t in range(STEPS)])
    w = topology(graph, workers).weights
    want = oracle_choco(x0, w, gamma, params, lambda t: np.float32(lr) * grads[t], STEPS,
                        [slice(0, 6), slice(6, 30)])  # bias, weight: each tensor compressed alone
    for t in range(STEPS):
        got = np.stack([flat(r, "choco", f"{t}/param") for r in runs])
        assert np.allclose(got, want[t], atol=2e-5), (t, np.abs(got - want[t]).max())
    average = flat(runs[0], "choco", "average")
    assert np.allclose(average, want[-1].mean(0), atol=1e-6)
    # D-PSGD with zero gradients: x <- W x each round
    x = np.stack([flat(r, "dpsgd", "init") for r in runs]).astype(np.float64)
    for t in range(4):
        x = w @ x
        assert np.allclose(np.stack([flat(r, "dpsgd", f"{t}/param") for r in runs]), x, atol=1e-6)


def test_a_dead_neighbour_stops_the_job_naming_it(tmp_path):
    configs = [{"name": "choco", "algorithm": "choco", "graph": "ring", "gamma": 0.3,
                "params": {"compressor": "topk", "k": 2}, "steps": 200, "lr": 0.01,
                "die_rank": 2, "die_step": 3}]
    result = run(configs, tmp_path, 4)
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "rank 2 dies now" in out
    assert "worker 2" in out or "rank 2" in out.replace("rank 2 dies now", "")
