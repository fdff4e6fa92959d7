"""Worker side of tests/test_ps_state_errors.py: bad states given to bps_gc.core.load_state_dict
on the parameter server, each refused with a StateError before anything is loaded. Writes
OUT_DIR/errors<rank>.json: {case: message}."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402
from bps_gc.compress import StateError  # noqa: E402
from bps_gc.compress.state_bytes import decode_state, encode_state  # noqa: E402
from bps_gc.ps.worker import codec_state  # noqa: E402

out_dir = sys.argv[1]
bps.init()
rank = bps.rank()
N = 2000  # two partitions of BYTEPS_PARTITION_BYTES=4096
bps.declare("x", shape=(N,), dtype=np.float32, compressor="topk", k=0.05, ef="vanilla")
bps.declare("y", shape=(N,), dtype=np.float32, compressor="topk", k=0.1, ef="vanilla")
bps.declare("d", shape=(N,), dtype=np.float32)
# a saved state: a few steps of another job's x and y (ranks differ: their errors are their own)
good = bps.state_dict()
rng = np.random.default_rng(rank)
for k, v in good.items():
    if isinstance(v, np.ndarray) and v.dtype == np.float32:
        v[...] = rng.standard_normal(v.shape)
before = bps.state_dict()
errors = {}


def refused(case, sd):
    try:
        bps.load_state_dict(sd)
    except StateError as e:
        errors[case] = str(e)
        now = bps.state_dict()  # nothing was loaded, here or on the servers
        assert all(np.array_equal(now[k], before[k]) if isinstance(now[k], np.ndarray) else now[k] == before[k]
                   for k in before), case
        return
    errors[case] = None


def renamed(sd, old, new):
    return {k.replace(f"/{old}/", f"/{new}/").replace(f".{old}/", f".{new}/"): v for k, v in sd.items()}


def without(sd, name):
    """``sd`` less tensor ``name``'s keys (``name`` may name one partition: "x/1")."""
    return {k: v for k, v in sd.items() if f"/{name}/" not in k and f".{name}/" not in k}


def only(sd, name):
    return {k: v for k, v in sd.items() if k not in without(sd, name)}


data = encode_state(good)
try:
    decode_state(data[:-7])
except StateError as e:
    errors["truncated"] = str(e)
try:
    decode_state(data[:20] + b"\xff" + data[21:])
except StateError as e:
    errors["corrupt"] = str(e)
# x's state where y's should be: saved with another k
other = {**without(good, "y"), **renamed(only(good, "x"), "x", "y")}
refused("other_setting", other)
refused("world_size", dict(good, **{"meta.size": 3}))
refused("other_rank", dict(good, **{"meta.rank": 1 - rank}))
refused("transport", dict(good, **{"meta.transport": "collective"}))
refused("undeclared", {**good, **renamed(only(good, "x"), "x", "z")})
refused("missing", without(good, "y"))
refused("partitions", without(good, "x/1"))
if rank == 0:  # the rank that restores the servers' state: a bad server part stops it all
    bad = dict(good)
    key = next(k for k in good if k.startswith("server/y/0/") and isinstance(good[k], np.ndarray))
    bad[key] = np.zeros(3, np.float32)
    refused("server_part", bad)
    # a malformed STATE_PUT reaching a server is refused by it
    part = bps.worker().tensors["x"].partitions[0]
    try:
        codec_state.exchange(bps.worker(), [codec_state.StateRequest(part.key, part.server, b"junk")])
    except StateError as e:
        errors["server_refuses_junk"] = str(e)
# drop mode: another world size, this rank's chains dropped, the servers' state kept
os.environ[codec_state.DROP_RANK_STATE] = "1"
bps.load_state_dict(dict(good, **{"meta.size": 3}))
now = bps.state_dict()
errors["drop_kept_worker"] = all(np.array_equal(now[k], before[k]) for k in before
                                 if k.startswith("worker/") and isinstance(before[k], np.ndarray))
errors["drop_loaded_server"] = all(np.array_equal(now[k], good[k]) for k in good
                                   if k.startswith("server/") and isinstance(good[k], np.ndarray))
del os.environ[codec_state.DROP_RANK_STATE]
bps.load_state_dict(good)
errors["loaded"] = all(np.array_equal(v, bps.state_dict()[k]) for k, v in good.items() if isinstance(v, np.ndarray))
g = np.ones(N, np.float32)
bps.push_pull(g, "x", ctx={"lr": 0.1}).wait()
try:
    bps.load_state_dict(good)
except StateError as e:
    errors["after_push"] = str(e)
if rank == 0:
    part = bps.worker().tensors["x"].partitions[0]
    try:
        codec_state.exchange(bps.worker(), [codec_state.StateRequest(
            part.key, part.server, encode_state({}))])
    except StateError as e:
        errors["server_after_round"] = str(e)
json.dump(errors, open(os.path.join(out_dir, f"errors{rank}.json"), "w"))
bps.shutdown()
