"""DistributedTrainer.save_states/load_states carry the codec state (issue 33): a tiny gluon model
on the parameter server (2 workers, 2 servers) trained N steps straight equals N/2 steps, a
checkpoint, a new job, N/2 more, bit for bit; the gluon file stays gluon's."""
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from cluster import run_local
from conftest import ROOT

if importlib.util.find_spec("mxnet") is None:
    pytest.skip("needs mxnet", allow_module_level=True)

JOB = os.path.join(ROOT, "tests", "mxnet_state_job.py")
ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1", "BYTEPS_MIN_COMPRESS_BYTES": "0",
       "BYTEPS_PARTITION_BYTES": "256"}
CONFIGS = {
    # momentum and weight decay move into the chain and the post-pull adapters
    "onebit_ef_nesterov": ({"compressor": "onebit", "scaling": True, "ef": "vanilla",
                            "momentum": "nesterov"}, {"momentum": 0.9, "wd": 1e-3}),
    "dgc": ({"compressor": "dgc", "k": 0.25}, {"momentum": 0.9, "wd": 1e-3}),
}


def run(tmp, spec):
    (tmp / "spec.json").write_text(json.dumps(spec))
    result = run_local([sys.executable, JOB, str(tmp / "spec.json"), str(tmp)], workers=2, servers=2,
                       env=ENV, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result


def test_trainer_resumes_bit_for_bit(tmp_path):
    spec = {"steps": 6, "lrs": [0.1, 0.1, 0.05, 0.05, 0.02, 0.02], "batch": 8,
            "configs": list(CONFIGS.values())}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    run(straight, spec)
    run(resumed, dict(spec, stop_at=2))
    for r in range(2):
        for j in range(len(CONFIGS)):  # gluon's own file and each rank's side file
            assert (resumed / f"ckpt{r}-{j}.states").stat().st_size > 0
            assert (resumed / f"ckpt{r}-{j}.states.bps_gc.rank{r}").stat().st_size > 0
    assert not list(resumed.glob("*.tmp*"))
    out = run(resumed, dict(spec, stop_at=2))
    assert out.stdout.count("resumed at step 3") == 2, out.stdout[-3000:]
    for r in range(2):
        want, got = np.load(straight / f"final{r}.npz"), np.load(resumed / f"final{r}.npz")
        assert len(want.files) == 4 * len(CONFIGS)
        for name in want.files:
            assert got[name].tobytes() == want[name].tobytes(), \
                f"rank {r} {name}: max diff {np.abs(got[name] - want[name]).max()}"
