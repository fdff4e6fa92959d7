"""bps_gc.torch.DiLoCo on the parameter server (BPS_GC_TRANSPORT=ps, ``bpslaunch --local``, one
server), the outer step on the workers: each fragment's pseudo-gradient is averaged by push_pull
under its own declared name (torch/exchange.py's PushPullExchange). Dense, after 5 outer rounds,
on 2 and 3 workers, every parameter equals test_diloco.py's single-process re-computation within
1e-6 relative (one fragment, staggered fragments, tau = 1). With top-k + error feedback on 3
workers: the global copies are bit-identical on every worker; stopped mid-window with a
fragment's exchange in flight, saved (model, DiLoCo, bps_gc.torch.state_dict()) and resumed in a
new launch, every parameter equals the straight run bit for bit. A process group is refused."""
import json
import os
import sys

import numpy as np
import pytest

from cluster import run_local
from conftest import ROOT
from test_diloco import CASES, build_model, recompute

JOB = os.path.join(ROOT, "tests", "diloco_ps_job.py")
COMPRESSED = {"sync_every": 4, "fragments": 2, "steps": 12, "stop_at": 4, "delay": 1,
              "compression_params": {"compressor": "topk", "k": 0.3, "ef": "vanilla"}}
WORKERS = 3


def launch(tmp, phase, workers):
    spec = tmp / f"{phase}.json"
    spec.write_text(json.dumps({"phase": phase, "cases": CASES, "compressed": COMPRESSED}))
    result = run_local([sys.executable, JOB, str(spec), str(tmp)], workers=workers, servers=1, timeout=240,
                       env={"BYTEPS_MIN_COMPRESS_BYTES": "0"})  # the biases are compressed too
    assert result.returncode == 0, f"{phase} failed ({result.returncode}):\n{result.stderr[-5000:]}"
    return [dict(np.load(tmp / f"{phase}{r}.npz")) for r in range(workers)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three launches: dense on 2 workers; everything on 3 workers; the resumed run on 3."""
    tmp = tmp_path_factory.mktemp("diloco_ps")
    return {"dense": launch(tmp, "dense", 2), "all": launch(tmp, "all", WORKERS),
            "resumed": launch(tmp, "resumed", WORKERS)}


@pytest.mark.parametrize("phase, workers", [("dense", 2), ("all", WORKERS)])
def test_dense_diloco_equals_the_recomputation(runs, phase, workers):
    got = runs[phase]
    for case, settings in CASES.items():
        want = recompute(*settings, replicas=workers)
        for rank in range(workers):
            for name, value in want[rank].items():
                np.testing.assert_allclose(got[rank][f"{case}/{name}"], value, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{workers} workers, {case}, rank {rank}, {name}")
        assert not np.array_equal(want[0]["0.weight"], build_model()[0].weight.detach().numpy())


def test_compressed_global_copies_are_bit_identical_on_every_worker(runs):
    got = runs["all"]
    names = [name for name in got[0] if name.startswith("global/")]
    assert len(names) == 4
    for rank in range(1, WORKERS):
        for name in names:
            assert got[rank][name].tobytes() == got[0][name].tobytes(), f"rank {rank} {name}"
    # top-k did compress: the run is not the dense one
    dense = recompute(COMPRESSED["sync_every"], COMPRESSED["fragments"], COMPRESSED["steps"], COMPRESSED["delay"],
                      replicas=WORKERS)
    assert max(np.abs(got[0][f"straight/{n}"] - v).max() / np.abs(v).max() for n, v in dense[0].items()) > 1e-3


def test_resumed_in_the_middle_of_a_window_equals_the_straight_run(runs):
    """H = 4, two fragments, tau = 1: saved after step 4, when fragment 1's exchange (started
    after step 4) is in flight; resumed in a new launch. The saving launch, trained on, ends
    bit-identical to the straight run too (runs repeat, saving changes nothing)."""
    for rank in range(WORKERS):
        every, resumed = runs["all"][rank], runs["resumed"][rank]
        names = [n.split("/", 1)[1] for n in every if n.startswith("straight/")]
        for name in names:
            straight = every[f"straight/{name}"].tobytes()
            assert resumed[f"resumed/{name}"].tobytes() == straight, f"rank {rank} {name}: resumed"
            assert every[f"first_end/{name}"].tobytes() == straight, f"rank {rank} {name}: runs differ"
        assert any(not np.array_equal(every[f"first/{n}"], every[f"straight/{n}"]) for n in names)


def test_a_process_group_is_refused_on_the_parameter_server(runs):
    message = str(runs["all"][0]["refused"])
    assert message.startswith("DiLoCo: the parameter server averages over every worker") and "\n" not in message
