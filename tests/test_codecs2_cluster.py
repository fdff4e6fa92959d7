"""Every issue-11 codec through the runtime, on a 2-worker x 2-server cluster and on 2 gloo
ranks: each pull equals the numpy re-computation of tests/reference.py (worker chains, the
reducer written out in numpy), bit for bit. One job per transport carries every codec in float32
and float16, with and without error feedback where the codec takes it, at sizes from 1 element
to 3 partitions; DGC's density comes with the step context. A 1-element threshold push that kept
nothing is an empty payload, which the transport must carry."""
import pytest

import test_cluster_reducers as ps
import test_collective_exact as collective

CODECS = {
    "terngrad": {"compressor": "terngrad"},
    "terngrad-clip": {"compressor": "terngrad", "clip": True},
    "qsgd": {"compressor": "qsgd", "levels": 4},
    "threshold": {"compressor": "threshold", "threshold": 0.8},
    "adaptive_threshold": {"compressor": "adaptive_threshold"},
    "sign": {"compressor": "sign"},  # reducer: majority
    "signnorm": {"compressor": "signnorm"},
    "dgc": {"compressor": "dgc", "k": 0.5},  # reducer: lossless; density 0.25 from ctx
}
NO_EF = ("dgc",)  # carries its own error feedback
SHAPES = {"one": [1], "odd": [37, 3], "three-partitions": [5000]}


def spec_for(dtypes=("float32", "float16")):
    tensors = []
    for dtype in dtypes:
        for codec, params in CODECS.items():
            for ef in (False,) if codec in NO_EF else (False, True):
                for label, shape in SHAPES.items():
                    p = dict(params, ef="vanilla") if ef else dict(params)
                    tensors.append({"name": f"{codec}-{'ef' if ef else 'plain'}-{label}-{dtype}",
                                    "shape": shape, "dtype": dtype, "params": p})
        tensors.append({"name": f"sum-{dtype}", "shape": [33], "dtype": dtype, "average": False, "params": {}})
    return {"steps": 3, "lrs": [0.1, 0.05, 0.02], "ctx": {"density": 0.25}, "partition_bytes": 8192,
            "min_compress_bytes": 0, "tensors": tensors}


@pytest.mark.parametrize("transport", ["ps", "gloo"])
def test_every_issue11_codec_exact(transport, tmp_path):
    spec = spec_for()
    if transport == "ps":
        ps.check(spec, tmp_path)
    else:
        collective.check(spec, tmp_path, 2)
