"""The DDP hook and the buckets' dtypes (docs/ddp_hook.md "Dtypes"), with real DDP on 2 gloo
ranks (the trained models under bpslaunch --servers 0, the refusal under torchrun): a float64
model is reduced in float64 by a codec that carries it, refused at its first bucket by one that
cannot, and a bfloat16 model is widened to float32 and rounded back, each against the numpy
re-computation; bps_gc.core.metrics() counts the hook's bytes without init()."""
import json
import os
import subprocess

import numpy as np
import pytest
import torch

from collective_cluster import job_env, torchrun_argv
from conftest import ROOT
from test_collective_hook import JOB, expected_buckets, run

TOPK = {"compressor": "topk", "k": 0.1, "ef": "vanilla"}


def record_spec(params, dtype, reducer="lossless"):
    return {"mode": "record", "steps": 3, "compression_params": params, "reducer": reducer, "dtype": dtype}


def record(tmp_path, spec):
    """The job under torchrun (its exit status is the test's to check)."""
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return subprocess.run(torchrun_argv([JOB, str(spec_path), str(tmp_path)], 2), env=job_env(),
                          capture_output=True, text=True, timeout=240, cwd=ROOT)


@pytest.fixture(scope="module")
def widths(tmp_path_factory):
    """One launch for both models that train (each in its own folder): float64, then bfloat16."""
    out = tmp_path_factory.mktemp("dtypes")
    run({"runs": [[dtype, record_spec(TOPK, dtype)] for dtype in ("float64", "bfloat16")]}, out)  # bpslaunch
    return out


def saved_calls(tmp_path):
    saved = [np.load(tmp_path / f"hook{r}.npz") for r in range(2)]
    count = len(saved[0]["index"])
    calls = [[(s["index"][i], s[f"sizes{i}"], s[f"in{i}"], s[f"params{i}"]) for i in range(count)] for s in saved]
    return saved, calls


def test_float64_model_is_reduced_in_float64_and_counted(widths):
    tmp_path = widths / "float64"
    saved, calls = saved_calls(tmp_path)
    assert saved[0]["in0"].dtype == np.float64
    sent = [0, 0]
    expected = expected_buckets(TOPK, calls, 2, 0.1, "lossless", wire=np.float64, sent=sent)
    for rank, s in enumerate(saved):
        for i, value in enumerate(expected):
            assert s[f"out{i}"].dtype == np.float64
            assert s[f"out{i}"].tobytes() == value.tobytes(), f"rank {rank} call {i}"
    # metrics() without init(): the hook's own counts, against the bytes re-computed here
    for rank in range(2):
        m = json.load(open(tmp_path / f"metrics{rank}.json"))
        raw = sum(grads.nbytes for _, _, grads, _ in calls[rank])
        assert m["pushed_raw"] == m["pulled_raw"] == raw
        assert m["pushed_wire"] == sent[rank] and m["pulled_wire"] == sent[1 - rank]
        assert 0 < m["pushed_wire"] < raw / 3  # top 10 %: (index, value) records


def test_float64_refused_at_the_first_bucket_by_a_codec_that_cannot_carry_it(tmp_path):
    result = record(tmp_path, record_spec({"compressor": "terngrad"}, "float64", reducer=None))
    assert result.returncode != 0
    assert ("DDP bucket 0 holds torch.float64 gradients, which compressor 'terngrad' cannot carry "
            "(TernGrad: float32 or float16 partitions only, got float64)") in result.stderr, result.stderr[-4000:]
    assert "bucket 1" not in result.stderr  # refused at the first, before anything was sent
    assert not (tmp_path / "hook0.npz").exists()


def test_bfloat16_model_is_widened_to_float32_and_rounded_back(widths):
    tmp_path = widths / "bfloat16"
    saved, calls = saved_calls(tmp_path)
    expected = expected_buckets(TOPK, calls, 2, 0.1, "lossless", wire=np.float32)
    for rank, s in enumerate(saved):
        for i, value in enumerate(expected):
            rounded = torch.from_numpy(value).to(torch.bfloat16).double().numpy()
            assert s[f"out{i}"].tobytes() == rounded.tobytes(), f"rank {rank} call {i}"
    raw = sum(grads.size * 2 for _, _, grads, _ in calls[0])  # bfloat16: 2 bytes an element
    assert json.load(open(tmp_path / "metrics0.json"))["pushed_raw"] == raw
