"""Server reducers and the step context on a real 2-worker x 2-server cluster over loopback:
every pull equals the numpy re-computation in tests/reference.py, bit for bit. Every reducer
case in both dtypes runs in one launch (a module fixture), each its own set of tensors."""
import numpy as np
import pytest

from cluster import run_job
from reference import expected_results

CASES = {
    "recompress": ({"compressor": "topk", "k": 0.01, "ef": "vanilla"}, "recompress"),
    "lossless": ({"compressor": "topk", "k": 0.01}, "lossless"),
    "lossless-randomk": ({"compressor": "randomk", "k": 0.02, "seed": 7}, "lossless"),
    "majority": ({"compressor": "onebit", "scaling": True}, "majority"),
    "majority-dense-reply": ({"compressor": "onebit"}, "majority"),
}
SHAPES = {"one": [1], "odd": [37, 3], "two-partitions": [70_001]}


def spec_for(params, reducer, dtype, steps=3):
    tensors = [{"name": label, "shape": shape, "dtype": dtype, "params": dict(params),
                "reducer": reducer} for label, shape in SHAPES.items()]
    tensors.append({"name": "sum", "shape": [33], "dtype": dtype, "average": False, "params": {}})
    return {"steps": steps, "lrs": [0.1, 0.05, 0.05, 0.02][:steps], "partition_bytes": 131_072,
            "min_compress_bytes": 0, "tensors": tensors}


def check(spec, tmp_path, env=None):
    results, metrics = run_job(spec, tmp_path, 2, 2, env)
    expected = expected_results(spec, 2)
    for rank, got in enumerate(results):
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            assert got[key].tobytes() == value.tobytes(), \
                f"rank {rank} {key}: max diff {np.abs(got[key] - value).max()}"
    return results, metrics


@pytest.fixture(scope="module")
def every_case(tmp_path_factory):
    """Every case in both dtypes, its tensors named ``<case>-<dtype>:<name>``, 3 steps, set
    after set in one launch: (each worker's results, the oracle's)."""
    spec = spec_for({}, None, "float32")
    spec["tensors"] = [dict(t, name=f"{case}-{dtype}:{t['name']}", set=f"{case}-{dtype}")
                       for case, (params, reducer) in CASES.items() for dtype in ("float32", "float16")
                       for t in spec_for(params, reducer, dtype)["tensors"]]
    results, _ = run_job(spec, tmp_path_factory.mktemp("every_case"), 2, 2)
    return results, expected_results(spec, 2)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", list(CASES))
def test_reducer_exact(case, dtype, every_case):
    results, oracle = every_case
    mine = f"{case}-{dtype}:"
    expected = {key: value for key, value in oracle.items() if key.startswith(mine)}
    assert expected
    for rank, got in enumerate(results):
        assert {key for key in got if key.startswith(mine)} == set(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            assert got[key].tobytes() == value.tobytes(), \
                f"rank {rank} {key}: max diff {np.abs(got[key] - value).max()}"


def test_lossless_topk_keeps_both_workers_entries(tmp_path):
    """The issue's case: topk k=10, two workers whose 10 entries do not overlap. lossless
    returns all 20 entries (as index/value pairs); recompress re-selects 10 of them."""
    spec = {"steps": 1, "lrs": [0.1], "partition_bytes": 4_096_000, "min_compress_bytes": 0,
            "tensors": [{"name": f"{reducer}", "shape": [5000], "dtype": "float32", "disjoint": 10,
                         "average": False, "params": {"compressor": "topk", "k": 10},
                         "reducer": reducer} for reducer in ("lossless", "recompress")]}
    results, metrics = check(spec, tmp_path)
    for got in results:
        assert np.count_nonzero(got["lossless/0"]) == 20
        assert np.count_nonzero(got["recompress/0"]) == 10
    # pulled: 20 records of 8 bytes (lossless) + 10 (recompress), not 20000 dense bytes
    assert all(m["pulled_wire"] == 20 * 8 + 10 * 8 for m in metrics)


def test_step_context_reaches_codecs_on_workers_and_servers(tmp_path):
    """A plugin codec (tests/plugin_step_codec.py, loaded by BPS_GC_PLUGINS on every node)
    keeps the indices that are multiples of step + 2, scaled by the context's ``gain``: the
    pulls match the numpy model only if the servers recompressed with each push's context."""
    import plugin_step_codec  # noqa: F401  (registers test_step_mask here too, for the model)
    spec = spec_for({"compressor": "test_step_mask"}, "recompress", "float32", steps=4)
    spec["lrs"] = [0.1, 0.1, 0.1, 0.1]
    spec["ctx"] = {"gain": 0.5}
    results, _ = check(spec, tmp_path, env={"BPS_GC_PLUGINS": "plugin_step_codec"})
    odd = results[0]["odd/3"].reshape(-1)  # step 3: every 5th index, twice scaled by 0.5
    assert np.count_nonzero(odd) == np.count_nonzero(np.arange(odd.size) % 5 == 0)


def test_unsupported_reducer_fails_at_declare(tmp_path):
    from cluster import run_local
    import sys
    code = (
        "import numpy as np, bps_gc.core as bps\n"
        "bps.init()\n"
        "for kw in ({'compressor': 'topk', 'k': 3, 'reducer': 'majority'},\n"
        "           {'compressor': 'onebit', 'reducer': 'mean'}, {'reducer': 'majority'}):\n"
        "    try:\n"
        "        bps.declare('t', shape=(100,), dtype=np.float32, **kw)\n"
        "    except ValueError as e:\n"
        "        print('REFUSED:', e, flush=True)\n"
        "d = bps.declare('z', shape=(0,), dtype=np.float32, compressor='topk', k=3)\n"
        "print('ZERO:', bps.push_pull(np.zeros(0, np.float32), 'z').wait(timeout=5).shape, d.reducer, flush=True)\n"
        "bps.shutdown()\n")
    result = run_local([sys.executable, "-c", code], workers=1, servers=1,
                       env={"BYTEPS_FORCE_DISTRIBUTED": "1"}, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "REFUSED: compressor 'topk' does not support reducer 'majority'" in out
    assert "REFUSED: unknown reducer 'mean'" in out
    assert "REFUSED: reducer 'majority' needs a compressor" in out
    assert "ZERO: (0,) recompress" in out
