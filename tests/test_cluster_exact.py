"""Every pulled result equals the numpy re-computation (worker chain, then server decode-sum-EF-
recode with its own state), bit for bit, on 2 workers x 2 servers over loopback.

The codec sets of the float32, float16 and fp16-wire tests (names prefixed by the set) run in
one launch (a module fixture), set after set, each with its own traffic counters."""
import json
import os

import numpy as np
import pytest

from cluster import run_job
from conftest import DATA
from reference import expected_results

CODECS = {
    "dense": {},
    "onebit": {"compressor": "onebit", "scaling": True},
    "topk": {"compressor": "topk", "k": 0.01},
    "randomk": {"compressor": "randomk", "k": 0.02},
    "dithering": {"compressor": "dithering", "k": 2},
    "dithering-natural-l2": {"compressor": "dithering", "k": 3, "partition": "natural", "normalize": "l2"},
}
SHAPES = {"one": [1], "odd": [37, 3], "two-partitions": [70_001]}


def spec_for(params, dtype, steps=3, ef=False):
    tensors = []
    for label, shape in SHAPES.items():
        p = dict(params, ef="vanilla") if ef and params else dict(params)
        tensors.append({"name": label, "shape": shape, "dtype": dtype, "params": p})
    tensors.append({"name": "sum", "shape": [33], "dtype": dtype, "average": False, "params": {}})
    return {"steps": steps, "lrs": [0.1, 0.05, 0.05, 0.02][:steps], "partition_bytes": 131_072,
            "min_compress_bytes": 0, "tensors": tensors}


def check(spec, tmp_path, workers=2, servers=2, env=None):
    results, metrics = run_job(spec, tmp_path, workers, servers, env)
    expected = expected_results(spec, workers)
    for rank, got in enumerate(results):
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            assert got[key].tobytes() == value.tobytes(), f"rank {rank} {key}: max diff {np.abs(got[key] - value).max()}"
    return metrics


CASES = [(codec, ef) for codec in CODECS for ef in (False, True) if codec != "dense" or not ef]


def fp16_wire_tensors():
    return [
        {"name": "fp16", "shape": [5000], "dtype": "float32", "params": {"compressor": "topk", "k": 50, "fp16": True}},
        {"name": "fp16-dense", "shape": [77], "dtype": "float32", "params": {"fp16": True}},
        {"name": "nesterov", "shape": [4000], "dtype": "float32",
         "params": {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}},
    ]


FLOAT16_CODECS = ["dense", "onebit", "topk", "dithering"]
SETS = {**{f"float32-{c}-{'ef' if e else 'plain'}": lambda c=c, e=e: spec_for(CODECS[c], "float32", ef=e)["tensors"]
           for c, e in CASES},
        **{f"float16-{c}": lambda c=c: spec_for(CODECS[c], "float16")["tensors"] for c in FLOAT16_CODECS},
        "fp16-wire": fp16_wire_tensors}


@pytest.fixture(scope="module")
def every_set(tmp_path_factory):
    """Every set's tensors (``<set>:<name>``), 3 steps, in one launch: (results, metrics, the
    oracle's results)."""
    spec = spec_for({}, "float32", steps=3)
    spec["tensors"] = [dict(t, name=f"{name}:{t['name']}", set=name) for name, make in SETS.items() for t in make()]
    results, metrics = run_job(spec, tmp_path_factory.mktemp("every_set"))
    return results, metrics, expected_results(spec, 2)


def check_set(every_set, tensor_set):
    """The set's results on every worker, bit for bit against the oracle; its counters."""
    results, metrics, oracle = every_set
    expected = {key: value for key, value in oracle.items() if key.startswith(f"{tensor_set}:")}
    assert expected
    for rank, got in enumerate(results):
        assert {key for key in got if key.startswith(f"{tensor_set}:")} == set(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            assert got[key].tobytes() == value.tobytes(), \
                f"rank {rank} {key}: max diff {np.abs(got[key] - value).max()}"
    return [m[tensor_set] for m in metrics]


@pytest.mark.parametrize("codec, ef", CASES, ids=[f"{c}-{'ef' if e else 'plain'}" for c, e in CASES])
def test_every_codec_exact_float32(codec, ef, every_set):
    metrics = check_set(every_set, f"float32-{codec}-{'ef' if ef else 'plain'}")
    if codec != "dense":
        assert all(m["ratio"] > 1.5 for m in metrics)


@pytest.mark.parametrize("codec", FLOAT16_CODECS)
def test_float16_tensors_exact(codec, every_set):
    check_set(every_set, f"float16-{codec}")


def test_fp16_on_the_wire_and_momentum(every_set):
    check_set(every_set, "fp16-wire")


def test_resnet50_gradient_set_with_onebit_ef(tmp_path):
    shapes = json.load(open(os.path.join(DATA, "resnet50_shapes.json")))["resnet50_v1b"]
    spec = {"steps": 2, "lrs": [0.1, 0.1], "partition_bytes": 4_096_000, "min_compress_bytes": 65_536,
            "tensors": [{"name": f"g{i}", "shape": s, "dtype": "float32", "scale": 0.01,
                         "params": {"compressor": "onebit", "scaling": True, "ef": "vanilla"}}
                        for i, s in enumerate(shapes)]}
    metrics = check(spec, tmp_path)
    assert all(m["ratio"] > 10 for m in metrics)


def test_three_workers_sum_in_rank_order(tmp_path):
    # with three or more pushes float addition order matters; the server sums by rank
    spec = spec_for({}, "float32", steps=2)
    check(spec, tmp_path, workers=3, servers=1)


def test_undeclared_shapes_are_placed_on_first_use(tmp_path):
    spec = spec_for(CODECS["topk"], "float32", steps=2)
    spec["declare_shapes"] = False
    check(spec, tmp_path)


def test_same_host_servers_over_tcp_when_unix_sockets_are_off(tmp_path):
    # every other test here reaches its same-host servers over their unix sockets (the default)
    check(spec_for(CODECS["topk"], "float32", steps=2), tmp_path, env={"BPS_GC_LOCAL_IPC": "0"})
