"""Two levels (BPS_GC_HIERARCHY=host, the default with several local ranks per host): 2 hosts
(network namespaces) x 3 local ranks, one bpslaunch per role. Every codec and reducer pulls,
bit for bit, what tests/local_ranks.py's HostModel computes: each host's sum compressed once by
its owner, the servers' reduction of one push per host (a majority vote is one vote per host).
BPS_GC_HIERARCHY=flat keeps the old path: reference.py's model of 6 separate pushers."""
import numpy as np

import reference
from local_ranks import expected_results, machines, run_spec  # noqa: F401

CODECS = {
    "dense": ({}, None),
    "fp16": ({"fp16": True}, None),
    "recompress": ({"compressor": "topk", "k": 0.05, "ef": "vanilla"}, "recompress"),
    "lossless": ({"compressor": "randomk", "k": 0.05, "seed": 7}, "lossless"),
    "majority": ({"compressor": "onebit", "scaling": True}, "majority"),
    "recipe-onebit": ({"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov",
                       "mu": 0.9}, None),
    "dithering": ({"compressor": "dithering", "k": 2, "normalize": "l2"}, None),
    "dgc": ({"compressor": "dgc", "k": 0.05}, None),
}
SPEC = {"steps": 2, "lrs": [0.1, 0.05], "partition_bytes": 2048, "min_compress_bytes": 0,
        "tensors": [{"name": name, "shape": [1100], "dtype": "float32", "params": params, "reducer": reducer}
                    for name, (params, reducer) in CODECS.items()]
        + [{"name": "sum", "shape": [7, 3], "dtype": "float32", "average": False, "params": {}}]}
POWERSGD = {"name": "powersgd", "shape": [24, 16], "dtype": "float32", "params": {"compressor": "powersgd", "rank": 2}}


def test_every_codec_two_levels_and_flat(machines, tmp_path):  # noqa: F811
    spec = dict(SPEC, tensors=SPEC["tensors"] + [POWERSGD])
    (tmp_path / "host").mkdir()
    (tmp_path / "flat").mkdir()
    two = run_spec(machines, spec, tmp_path / "host", hosts=2, local_size=3, servers=2)
    flat = run_spec(machines, spec, tmp_path / "flat", hosts=2, local_size=3, servers=2,
                    env={"BPS_GC_HIERARCHY": "flat"})
    host_model, flat_model = expected_results(SPEC, 2, 3), reference.expected_results(SPEC, 6)
    for rank in range(6):
        for key in host_model:
            assert two[rank][key].tobytes() == host_model[key].tobytes(), \
                f"two levels, rank {rank} {key}: max diff {np.abs(two[rank][key] - host_model[key]).max()}"
            assert flat[rank][key].tobytes() == flat_model[key].tobytes(), f"flat, rank {rank} {key}"
        for step in range(spec["steps"]):
            # PowerSGD: every rank still compresses its own gradient; the phases' sums are the
            # same sums, added in another order
            key = f"powersgd/{step}"
            np.testing.assert_allclose(two[rank][key], flat[0][key], rtol=1e-4, atol=1e-5)
            assert two[rank][key].tobytes() == two[0][key].tobytes()
    # the host level changes what a codec sees: the sums differ from the flat path's
    assert two[0]["recompress/0"].tobytes() != flat[0]["recompress/0"].tobytes()
