"""A sparse codec that keeps nothing sends an empty payload, and a lossless sum of nothing
replies with one: both cross the transport as an empty frame (they used to be dropped as
malformed, and the job hung). Entire-model chunks that a top-k misses hit this every step."""
import numpy as np

from cluster import run_job


def test_empty_pushes_and_replies_complete(tmp_path):
    params = {"compressor": "threshold", "threshold": 1e9}  # nothing reaches it
    spec = {"partition_bytes": 4096, "min_compress_bytes": 0, "steps": 2, "lrs": [0.1, 0.1],
            "tensors": [{"name": "lossless", "shape": [300], "dtype": "float32", "params": params,
                         "reducer": "lossless"},
                        {"name": "recompress", "shape": [300], "dtype": "float32", "params": params,
                         "reducer": "recompress"}]}
    results, metrics = run_job(spec, tmp_path, workers=2, servers=1)
    for rank in results:
        assert sorted(rank) == ["lossless/0", "lossless/1", "recompress/0", "recompress/1"]
        assert all(not a.any() for a in rank.values())
    assert all(m["pushed_wire"] == 0 for m in metrics)
