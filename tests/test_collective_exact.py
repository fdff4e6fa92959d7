"""On torch.distributed (gloo, loopback) every codec gives what the parameter server gives:
the numpy re-computation of tests/reference.py (worker chains, rank-ordered decode-and-sum, the
server chain's recompression), bit for bit for compressed tensors. Dense sums are all_reduce:
gloo's ring adds in its own order, so with more than two ranks they match to float rounding."""
import numpy as np
import pytest

from collective_cluster import run_collective_job
from reference import PushPullModel, expected_results
from test_cluster_exact import CODECS, SHAPES


def spec_all_codecs(dtype, steps=3, codecs=CODECS, efs=(False, True)):
    tensors = []
    for codec, params in codecs.items():
        for ef in efs if params else (False,):
            for label, shape in SHAPES.items():
                p = dict(params, ef="vanilla") if ef else dict(params)
                tensors.append({"name": f"{codec}-{'ef' if ef else 'plain'}-{label}", "shape": shape,
                                "dtype": dtype, "params": p})
    tensors.append({"name": "sum", "shape": [33], "dtype": dtype, "average": False, "params": {}})
    return {"steps": steps, "lrs": [0.1, 0.05, 0.05, 0.02][:steps], "partition_bytes": 131_072,
            "min_compress_bytes": 0, "tensors": tensors}


def check(spec, tmp_path, ranks, **kwargs):
    results = run_collective_job(spec, tmp_path, ranks, **kwargs)
    expected = expected_results(spec, ranks)
    models = {t["name"]: PushPullModel(t.get("params"), t["shape"], t["dtype"], 0, 1, spec["partition_bytes"],
                                       spec["min_compress_bytes"]) for t in spec["tensors"]}
    for rank, got in enumerate(results):
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype, key
            model = models[key.split("/")[0]]
            if model.compressed or ranks == 2:
                assert got[key].tobytes() == value.tobytes(), \
                    f"rank {rank} {key}: max diff {np.abs(got[key].astype(float) - value).max()}"
            else:
                # a few roundings of the wire dtype apart (sums of ~N(0, 4) values)
                tol = 4e-3 if model.wire == np.float16 else 1e-5
                np.testing.assert_allclose(got[key], value, rtol=tol, atol=tol, err_msg=f"rank {rank} {key}")
    return results


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_codec_and_ef_float32(ranks, tmp_path):
    check(spec_all_codecs("float32"), tmp_path, ranks)


@pytest.mark.parametrize("ranks", [2, 4])
def test_float16_tensors_and_fp16_wire(ranks, tmp_path):
    spec = spec_all_codecs("float16", steps=2, codecs={c: CODECS[c] for c in ("dense", "onebit", "topk", "randomk", "dithering")})
    spec["tensors"] += [
        {"name": "fp16-wire", "shape": [5000], "dtype": "float32", "params": {"compressor": "topk", "k": 50, "fp16": True}},
        {"name": "fp16-dense", "shape": [77], "dtype": "float32", "params": {"fp16": True}},
        {"name": "nesterov", "shape": [4000], "dtype": "float32",
         "params": {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}},
    ]
    check(spec, tmp_path, ranks)


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_reducer_and_the_step_context(ranks, tmp_path):
    """recompress, lossless and majority (a sign all_reduce here) as the parameter server runs
    them (test_cluster_reducers.py), plus a codec whose output depends on the step context."""
    import plugin_step_codec  # noqa: F401  (the model needs test_step_mask registered too)
    from test_cluster_reducers import CASES
    tensors = [{"name": f"{case}-{label}", "shape": shape, "dtype": "float32", "params": dict(params),
                "reducer": reducer}
               for case, (params, reducer) in CASES.items() for label, shape in SHAPES.items()]
    tensors.append({"name": "step-mask", "shape": [37, 3], "dtype": "float32",
                    "params": {"compressor": "test_step_mask"}})
    spec = {"steps": 3, "lrs": [0.1, 0.1, 0.1], "ctx": {"gain": 0.5}, "partition_bytes": 131_072,
            "min_compress_bytes": 0, "tensors": tensors}
    results = check(spec, tmp_path, ranks, env={"BPS_GC_PLUGINS": "plugin_step_codec"})
    votes = results[0]["majority-odd/2"]
    assert set(np.unique(votes)) <= {-1.0, 1.0}  # a vote, not averaged
