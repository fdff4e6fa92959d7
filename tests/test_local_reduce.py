"""BPS_GC_LOCAL_REDUCE=1: workers on one host sum dense tensors in shared memory, no server in
the path (ps/worker/local.py).

* Every pull equals the numpy re-computation bit for bit, on 2 and 4 workers, for float16/32/64,
  averaged or summed, in place or not, with a compressed tensor beside them that still goes
  through the servers; the dense tensors send no message at all.
  (tests/test_codecs2_cluster.py also runs every issue-11 codec and PowerSGD's phases with it.)
* Faults, one bpslaunch per role: kill -9 of a worker, a worker that raises, Ctrl-C, a worker
  that ends early: the others stop within the bound naming the worker, nothing left behind.
* A worker passing another shape gets a ValueError naming both sizes; a worker whose setting
  disagrees is refused at the start, naming the variable.
"""
import os
import signal
import sys
import textwrap
import time

import numpy as np
import pytest

from cluster import run_job, run_local
from multihost import INTERVAL, TIMEOUT, Job
from reference import expected_results

ON = {"BPS_GC_LOCAL_REDUCE": "1"}
BOUND = TIMEOUT + 2 * INTERVAL + 5.0  # as tests/test_cluster_faults.py
START_BOUND = 60.0


def dense_spec():
    tensors = [{"name": f"{label}-{dtype}", "shape": shape, "dtype": dtype, "params": {}}
               for dtype in ("float32", "float16", "float64")
               for label, shape in {"one": [1], "odd": [37, 3], "big": [70_001]}.items()]
    tensors.append({"name": "sum", "shape": [33], "dtype": "float32", "average": False, "params": {}})
    return {"steps": 3, "lrs": [0.1, 0.05, 0.02], "partition_bytes": 131_072, "min_compress_bytes": 0,
            "tensors": tensors}


def check(spec, results, workers):
    expected = expected_results(spec, workers, servers_sum=False)  # no server sums the dense ones
    for rank, got in enumerate(results):
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            assert got[key].tobytes() == value.tobytes(), \
                f"rank {rank} {key}: max diff {np.abs(got[key].astype(float) - value).max()}"


@pytest.mark.parametrize("workers", [2, 4])
def test_dense_tensors_exact_without_a_server_message(workers, tmp_path):
    spec = dense_spec()
    results, metrics = run_job(spec, tmp_path, workers, 2, ON)
    check(spec, results, workers)
    dense_bytes = spec["steps"] * sum(int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize
                                      for t in spec["tensors"])
    for m in metrics:
        assert m["messages"] == 0 and m["pushed_wire"] == 0 and m["shared_bytes"] == dense_bytes, m


def test_off_by_default_and_beside_a_compressed_tensor(tmp_path):
    spec = dense_spec()
    spec["tensors"].append({"name": "topk", "shape": [5000], "dtype": "float32",
                            "params": {"compressor": "topk", "k": 0.01, "ef": "vanilla"}})
    (tmp_path / "on").mkdir()
    results, metrics = run_job(spec, tmp_path / "on", 2, 2, ON)
    check(spec, results, 2)
    assert all(m["pushed_wire"] > 0 and m["messages"] > 0 for m in metrics), metrics  # topk: servers
    (tmp_path / "off").mkdir()
    results, metrics = run_job(spec, tmp_path / "off", 2, 2)
    check(spec, results, 2)
    dense = sum(int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize for t in spec["tensors"][:-1])
    # the dense bytes go to the servers now: every one of them is on the wire or in their shared memory
    assert all(m["pushed_wire"] + m["shared_bytes"] >= spec["steps"] * dense for m in metrics), metrics


TRAIN = textwrap.dedent("""
    import os, numpy as np, bps_gc.core as bps, time
    bps.init()
    rank = bps.rank()
    steps = int(os.environ.get(f"STEPS_{rank}", "1000000"))
    mode = os.environ.get(f"MODE_{rank}", "")
    n = int(os.environ.get(f"SIZE_{rank}", "200000"))
    if os.environ.get("BF16"):  # numpy cannot add bfloat16 in shared memory
        from bps_gc.wire.bfloat16 import BFLOAT16
        try:
            bps.declare("bf16", shape=(4,), dtype=BFLOAT16)
        except TypeError as e:
            print("REFUSED", e, flush=True)
    bps.declare("grad", dtype=np.float32)
    for step in range(steps):
        try:
            out = bps.push_pull(np.ones(n, np.float32), "grad", average=False).wait()
        except ValueError as e:
            print("REFUSED", e, flush=True)
            raise SystemExit(3)
        assert out[0] == bps.size(), out[:4]
        if step == 2:
            m = bps.metrics()
            print("RUNNING shared", m.shared_bytes, "messages", m.messages, flush=True)
        if step == 5 and mode == "raise":
            raise RuntimeError("the training script failed")
        time.sleep(0.005)
    print("DONE", steps, flush=True)
    bps.shutdown()
""")


@pytest.mark.parametrize("mode", ["kill", "raise", "sigint", "fewer"])
def test_multihost_worker_lost_stops_the_others(mode):
    env = dict(ON, **({"MODE_1": "raise"} if mode == "raise" else {"STEPS_1": "8"} if mode == "fewer" else {}))
    job = Job(3, TRAIN, env=env)
    statuses = None
    try:
        job.wait_output(["worker0", "worker1", "worker2"], "RUNNING", START_BOUND)
        if mode in ("raise", "fewer"):
            job.wait_output(["worker1"], "DONE" if mode == "fewer" else "RuntimeError", START_BOUND)
        if mode == "kill":
            victim = job.child_of("worker1")
            os.kill(victim, signal.SIGKILL)
        elif mode == "sigint":
            job.launchers["worker1"].send_signal(signal.SIGINT)  # Ctrl-C at worker 1's terminal
        lost_at = time.monotonic()
        statuses, elapsed = job.wait_all(BOUND, since=lost_at)
    finally:
        job.kill_all()
    report = job.report(statuses)
    assert "shared 2400000 messages 0" in job.text("worker0"), report  # 3 rounds of 800 KB, no server
    expected_zero = {"worker1"} if mode == "fewer" else set()
    assert all((s == 0) == (n in expected_zero) for n, s in statuses.items()), report
    # killed: the scheduler's heartbeats find it; otherwise it said goodbye, and the first worker
    # needing it has the scheduler stop the job
    named = "worker 1 (node" if mode == "kill" else "worker 1 left the job: push_pull of 'grad' cannot complete"
    for survivor in ("worker0", "worker2"):
        text = job.text(survivor)
        assert "NodeFailure" in text and named in text and "Traceback" not in text, report
    print(f"local reduce, worker 1 {mode}: every launcher exited after {elapsed:.2f} s", file=sys.stderr)


def test_another_shape_is_refused_naming_both_sizes():
    """And a bfloat16 tensor every worker would push (the host would sum it) in one line."""
    result = run_local([sys.executable, "-c", TRAIN], workers=2, servers=1,
                       env=dict(ON, SIZE_1="100", STEPS_0="3", STEPS_1="3", BF16="1"), timeout=START_BOUND)
    assert "REFUSED 'bf16': bfloat16 is pushed dense, as one local rank's own tensor (one_per_host, an " \
           "FSDP shard) or, on the parameter server with no host's sum" in result.stdout, result.stdout[-3000:]
    assert result.returncode != 0
    assert "REFUSED push_pull('grad'): worker 1 reduces 400 bytes, this worker 800000" in result.stdout, \
        result.stdout[-3000:] + result.stderr[-3000:]
    assert "REFUSED push_pull('grad'): worker 0 reduces 800000 bytes, this worker 400" in result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_worker_with_the_setting_off_is_refused_at_the_start():
    job = Job(2, TRAIN, env=dict(ON, STEPS_0="3", STEPS_1="3"),
              role_env={"worker1": {"BPS_GC_LOCAL_REDUCE": "0"}})
    statuses, _ = job.wait_all(START_BOUND)
    report = job.report(statuses)
    assert statuses["worker1"] != 0, report
    assert "BPS_GC_LOCAL_REDUCE=0" in job.text("worker1") and "Traceback" not in job.text("worker1"), report
