"""bps_gc.torch.comm_hook does not hold DDP's backward (2 gloo ranks, real DDP; bpslaunch
--servers 0, and torchrun for the killed peer):
its call returns in a small fraction of the time its future takes; a bucket's steps run in
order (results equal the numpy re-computation of each step after the previous one, futures
complete in call order); a codec error on one rank reaches backward() on every rank, naming
it, and a killed peer ends the other rank with a NodeFailure within seconds. Its device-chain
path gives the numpy bytes on CPU tensors (BPS_GC_DEVICE_CODECS=torch), and on CUDA where
there is one."""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from collective_cluster import TESTS, bpslaunch_argv, free_port, job_env, torchrun_argv
from conftest import ROOT
from test_collective_hook import expected_buckets

JOB = os.path.join(TESTS, "hook_async_job.py")
TOPK_EF = {"compressor": "topk", "k": 0.01, "ef": "vanilla"}
THRESHOLD = {"compressor": "threshold", "threshold": 1.0}  # as hook_async_job.py's


def run(spec, tmp_path, timeout=180):
    """The job on 2 ranks under bpslaunch --servers 0 (gloo as under torchrun, without its agent:
    ~1.7 s of CPU); the killed-peer test keeps torchrun's agents."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    result = subprocess.run(bpslaunch_argv([JOB, str(tmp_path / "spec.json"), str(tmp_path)], 2), env=job_env(),
                            capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


@pytest.fixture(scope="module")
def overlap_and_error(tmp_path_factory):
    """One job for three tests (the processes' start-up is most of their time)."""
    out = tmp_path_factory.mktemp("hook_async")
    run({"mode": "overlap_and_error", "steps": 4, "compression_params": TOPK_EF, "refuser": 1}, out)
    return out


def test_hook_returns_before_its_reduction_ends_and_keeps_each_buckets_steps_in_order(overlap_and_error):
    tmp_path = overlap_and_error
    for rank in range(2):
        calls = json.loads((tmp_path / f"calls{rank}.json").read_text())
        assert len(calls) >= 8 and all(done is not None for _, done in calls)
        later = calls[len(calls) // 4:]  # after the first step (the hook's process group is made then)
        held = sum(h for h, _ in later) / sum(d for _, d in later)
        # the old hook returned only when the reduction was over: held fraction 1
        assert held < 0.5, f"rank {rank}: the hook call took {held:.0%} of its reduction ({calls})"
    # the hook called directly: buckets 0, 1, 0, 1, 0, 1, waited for only after the last call;
    # with topk (payloads of one length: one all_gather per bucket after its first) and with
    # threshold (lengths that vary by rank and step: the exchange's second all_gather)
    for name, params in (("order", TOPK_EF), ("order_threshold", THRESHOLD)):
        saved = [np.load(tmp_path / f"{name}{r}.npz") for r in range(2)]
        sizes = {0: [3000, 500], 1: [2000]}
        calls = [[(n % 2, sizes[n % 2], s[f"in{n}"]) for n in range(6)] for s in saved]
        expected = expected_buckets(params, calls, 2, 0.0, "recompress")  # both codecs' default reducer
        for rank, s in enumerate(saved):
            assert list(s["done"]) == list(range(6)), f"{name}, rank {rank}: futures completed in {list(s['done'])}"
            for n, value in enumerate(expected):
                assert s[f"out{n}"].tobytes() == value.tobytes(), f"{name}, rank {rank} call {n}"


def test_codec_error_on_one_rank_reaches_backward_on_every_rank(overlap_and_error):
    tmp_path = overlap_and_error
    raised = [json.loads((tmp_path / f"error{r}.json").read_text()) for r in range(2)]
    assert raised[1] is not None and "ValueError: test_refuses: rank 1 refuses step 1" in raised[1]["message"], raised
    assert "compressing DDP bucket 0 failed" in raised[1]["message"], raised
    assert raised[0] is not None and "rank 1 could not make their payloads" in raised[0]["message"], raised


def test_killed_peer_ends_the_other_rank_with_a_node_failure(tmp_path):
    """Two torchrun agents (as on two hosts), so that the survivor's agent does not stop it;
    under bps_gc.torch.init() the collective communicator's heartbeat watches the hook's waits
    (without it, gloo's error on the closed socket becomes the NodeFailure: same bound here)."""
    (tmp_path / "spec.json").write_text(json.dumps({"mode": "die", "init": True}))
    port = free_port()
    procs = [subprocess.Popen(torchrun_argv([JOB, str(tmp_path / "spec.json"), str(tmp_path)], 1, port, nnodes=2,
                                            node_rank=node), env=job_env(), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in range(2)]
    try:
        stderr = procs[0].communicate(timeout=120)[1]
        ended = time.time()
        procs[1].communicate(timeout=60)
        killed = float((tmp_path / "killing-1").read_text())
        assert procs[0].returncode != 0 and "terminate called" not in stderr and "SIGABRT" not in stderr, stderr[-3000:]
        assert "NodeFailure: bps_gc: rank 1" in stderr, stderr[-3000:]
        # killed: its sockets close (gloo's error), or its heartbeat stops (3 s + 0.2 s here); the
        # slack covers torchrun's agent ending after its rank on a loaded box (10.6 s seen at load 10)
        assert ended - killed < 3.2 + 10.0, f"rank 0 ended {ended - killed:.1f} s after rank 1 was killed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()


def check_recorded(saved, ranks, exact):
    assert all(s["device_chains"].all() for s in saved)  # every bucket took the device path
    count = len(saved[0]["index"])
    assert len(set(saved[0]["index"])) >= 2  # several buckets (after DDP regroups them)
    calls = [[(s["index"][i], s[f"sizes{i}"], s[f"in{i}"], s[f"params{i}"]) for i in range(count)] for s in saved]
    expected = expected_buckets(TOPK_EF, calls, ranks, 0.0, "recompress")
    for rank, s in enumerate(saved):
        for i, value in enumerate(expected):
            if exact:
                assert s[f"out{i}"].tobytes() == value.tobytes(), f"rank {rank} call {i}"
            else:  # a GPU's sums may round differently from numpy's
                np.testing.assert_allclose(s[f"out{i}"], value, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} call {i}")


def test_device_chain_path_on_cpu_equals_numpy_recomputation(overlap_and_error):
    """BPS_GC_DEVICE_CODECS=torch: the hook's device path (device chains, device reducers,
    all_gather_tensors) on CPU tensors gives the numpy chains' bytes."""
    check_recorded([np.load(overlap_and_error / f"torch{r}.npz") for r in range(2)], 2, exact=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False here)")
def test_cuda_buckets_equal_numpy_recomputation(tmp_path):
    """CUDA buckets (device chains, side stream, device future, NCCL exchange): one rank per
    GPU, at most 2."""
    ranks = min(2, torch.cuda.device_count())
    (tmp_path / "spec.json").write_text(json.dumps({"mode": "cuda", "compression_params": TOPK_EF}))
    result = subprocess.run(torchrun_argv([JOB, str(tmp_path / "spec.json"), str(tmp_path)], ranks), env=job_env(),
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    check_recorded([np.load(tmp_path / f"cuda{r}.npz") for r in range(ranks)], ranks, exact=False)
