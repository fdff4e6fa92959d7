"""Shared memory between a worker and a server on its host (wire/shm.py, BPS_GC_SHM):
the same sums as over the socket, exact against numpy, with the dense bytes moved through
memory; offers that cannot be used fall back to the socket. Real processes."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bps_gc.wire import shm
from cluster import run_job
from conftest import LAUNCH_PYTHONPATH, ROOT
from reference import expected_results

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs Linux memfd and /proc")

PEER = """
import json, sys
from bps_gc.wire.shm import PeerMaps, ShmUnavailable
offer, nbytes = json.loads(sys.argv[1]), int(sys.argv[2])
try:
    view = PeerMaps().view(offer, nbytes)
    print(json.dumps({"data": view.tobytes().hex(), "writable": bool(view.flags.writeable)}))
except ShmUnavailable as e:
    print(json.dumps({"refused": str(e)}))
"""


def peer_view(offer, nbytes):
    """What another process sees of ``offer``."""
    out = subprocess.run([sys.executable, "-c", PEER, json.dumps(offer), str(nbytes)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_another_process_reads_an_offer_and_refuses_wrong_ones():
    arena = shm.Arena(chunk_bytes=1 << 16)
    try:
        offer, view = arena.allocate(1000)
        data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8)
        view[:] = data
        seen = peer_view(offer, 1000)
        assert bytes.fromhex(seen["data"]) == data.tobytes()
        assert seen["writable"] is False  # peers map read-only
        big_offer, big = arena.allocate(1 << 17)  # larger than a chunk: a chunk of its own
        big[-1] = 7
        assert bytes.fromhex(peer_view(big_offer, 1 << 17)["data"])[-1] == 7
        assert "nonce differs" in peer_view({**offer, "nonce": "00" * 16}, 1000)["refused"]
        assert "expected 999" in peer_view(offer, 999)["refused"]
        assert "past the end" in peer_view({**offer, "offset": 1 << 15, "bytes": 1 << 16}, 1 << 16)["refused"]
        assert "cannot open" in peer_view({**offer, "fd": 1000}, 1000)["refused"]
        assert "malformed" in peer_view({"pid": "x"}, 1000)["refused"]
        with open(os.devnull) as other:  # a descriptor that is not shared memory
            assert peer_view({**offer, "fd": other.fileno()}, 1000).get("refused")
    finally:
        arena.close()


def dense_spec():
    """Dense tensors over and under the fusion threshold, fp32 and fp16."""
    shapes = [(300_000,), (70_000,), (1000,), (64, 3, 7, 7)]
    kinds = [(s, dtype) for s in shapes for dtype in ("float32", "float16")]
    tensors = [{"name": f"g{i}", "shape": s, "dtype": dtype, "scale": 0.1, "params": {}}
               for i, (s, dtype) in enumerate(kinds)]
    return {"steps": 3, "lrs": [0.1] * 3, "partition_bytes": 400_000, "min_compress_bytes": 65_536,
            "tensors": tensors}


@pytest.mark.parametrize("case", ["shm", "off", "one worker off"])
def test_dense_sums_are_exact_through_shared_memory_or_not(tmp_path, case):
    spec = dense_spec()
    expected = expected_results(spec, 2)
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    env = {"BPS_GC_SHM": "0"} if case == "off" else {}
    if case == "one worker off":  # worker 1 declines: its pushes stay on the socket
        spec["shm_off_worker"] = 1
    results, metrics = run_job(spec, tmp_path, env=env)
    for rank, got in enumerate(results):
        for key, value in expected.items():
            assert got[key].tobytes() == value.tobytes(), f"{case}: rank {rank} {key}"
    shared = [m["shared_bytes"] for m in metrics]
    large = sum(int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize for t in spec["tensors"]
                if int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize > 65_536)
    print(f"{case}: bytes pushed through shared memory per worker {shared} (tensors over 64 KiB: "
          f"{large} B x {spec['steps']} steps)")
    # a key's first push may go before the server's INIT_ACK (which maps the slot) is back
    least = large * (spec["steps"] - 1)
    if case == "shm":
        assert all(s >= least for s in shared)
    elif case == "off":
        assert shared == [0, 0]
    else:
        assert shared[0] >= least and shared[1] == 0
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after <= before, f"left in /dev/shm: {after - before}"
