"""Fusion of small dense tensors (BPS_GC_FUSION_BYTES): the same results as without it, in
fewer push messages. Real processes, 2 workers x 2 servers over loopback; shared memory off
(BPS_GC_SHM=0), whose bare headers are batched on their own (tests/test_shm.py)."""
import json
import os

import numpy as np

from cluster import run_job
from conftest import DATA
from reference import expected_results, partitions


def test_fusion_gives_the_same_results_in_fewer_messages(tmp_path):
    shapes = json.load(open(os.path.join(DATA, "resnet50_shapes.json")))["resnet50_v1b"]
    spec = {"steps": 3, "lrs": [0.1, 0.1, 0.1], "partition_bytes": 4_096_000,
            "min_compress_bytes": 65_536,
            "tensors": [{"name": f"g{i}", "shape": s, "dtype": "float32", "scale": 0.01, "params": {}}
                        for i, s in enumerate(shapes)]}
    expected = expected_results(spec, 2)
    runs = {}
    for label, fusion in (("off", "0"), ("on", str(1 << 20))):
        out = tmp_path / label
        out.mkdir()
        # dense partitions as large as the spec's, as before BPS_GC_DENSE_PARTITION_BYTES cut
        # ResNet-50's large tensors finer: 175 partitions per step
        results, metrics = run_job(spec, out, env={"BPS_GC_FUSION_BYTES": fusion, "BPS_GC_SHM": "0",
                                                   "BPS_GC_DENSE_PARTITION_BYTES": str(spec["partition_bytes"])})
        for rank, got in enumerate(results):
            for key, value in expected.items():
                assert got[key].tobytes() == value.tobytes(), f"fusion {label}, rank {rank} {key}"
        runs[label] = [m["messages"] for m in metrics]
    keys = sum(len(partitions(int(np.prod(s)), np.float32, spec["partition_bytes"])) for s in shapes)
    print(f"push messages per worker for {len(shapes)} tensors ({keys} partitions) x "
          f"{spec['steps']} steps: without fusion {runs['off']}, with fusion {runs['on']}")
    assert all(m == keys * spec["steps"] for m in runs["off"])
    assert all(on < off / 2 for on, off in zip(runs["on"], runs["off"]))
