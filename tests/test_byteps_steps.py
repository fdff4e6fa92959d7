"""Our chains against BytePS 0.2.5.post15's own, byte for byte at every one of 10 steps:
error feedback and nesterov momentum once their state is no longer zero, and the server's
recompression of two workers' sum. The vectors (tests/data/byteps_steps/) were written by
scripts/byteps_ref/multistep.py from BytePS's compressor sources; nothing of BytePS is built
here.

Two differences are by design, each named where it applies (docs/codecs.md, "Multi-step"):
- TOPK_HEAP_ORDER: BytePS emits topk's records in its heap's order; the contract is the set of
  (index, value) records, so those payloads compare as sets.
- NO_FMA: the vectors come from a build with -ffp-contract=off. BytePS's own -march=native
  build fuses nesterov's ``g + mu * m`` into one multiply-add on CPUs with FMA (one rounding);
  bps_gc rounds the product and the sum separately, as numpy does.
"""
import json
import os

import numpy as np
import pytest

from bps_gc.compress import CompressionParams, build_chain
from bps_gc.compress.reducers import make_reducer
from bps_gc.compress.sparse import RECORD
from conftest import DATA

VECTORS = os.path.join(DATA, "byteps_steps")
MANIFEST = json.load(open(os.path.join(VECTORS, "manifest.json")))
CASES = MANIFEST["cases"]
GRADS = np.load(os.path.join(VECTORS, MANIFEST["gradients"]), allow_pickle=False)
CTX = {"lr": MANIFEST["lr"]}
TOPK_HEAP_ORDER = "topk records compare as a set: BytePS emits them in heap order"
NO_FMA = "the reference is built with -ffp-contract=off (docs/codecs.md, Multi-step)"


def expected(case):
    with np.load(os.path.join(VECTORS, case["file"]), allow_pickle=False) as z:
        return ([z[f"payload{s}"] for s in range(MANIFEST["steps"])],
                [z[f"decoded{s}"] for s in range(MANIFEST["steps"])])


def same_payload(params, got, want):
    if params["compressor"] == "topk":  # TOPK_HEAP_ORDER
        def records(p):
            rec = np.frombuffer(bytes(p), RECORD[np.float32])
            return sorted((int(i), v.tobytes()) for i, v in zip(rec["i"], rec["v"]))
        return len(bytes(got)) == len(bytes(want)) and records(got) == records(want)
    return bytes(got) == bytes(want)


def our_steps(case):
    """(payloads, decodings) of our chain over the manifest's steps: a worker's chain on worker
    0's stream, or two workers' chains and the server's recompress reducer."""
    params, n = case["params"], MANIFEST["n"]
    bare = {k: v for k, v in params.items() if k not in ("ef", "momentum", "mu")}
    decoder = build_chain(bare, n, np.float32, role="server")
    workers = [build_chain(params, n, np.float32, role="worker") for _ in range(2)]
    server = (make_reducer("recompress", CompressionParams.from_dict(params), n, np.float32)
              if case["server"] else None)
    payloads, decodings = [], []
    for s in range(MANIFEST["steps"]):
        if server is None:
            payload = workers[0].compress(GRADS[0, s].copy(), CTX)
        else:
            pushes = [bytes(w.compress(GRADS[i, s].copy(), CTX)) for i, w in enumerate(workers)]
            payload = server.reduce([np.frombuffer(p, np.uint8) for p in pushes], True, CTX)
        payload = np.frombuffer(bytes(payload), np.uint8)
        payloads.append(payload)
        decodings.append(decoder.decompress(payload).copy())
    return payloads, decodings


def test_vectors_cover_every_chain_the_issue_names():
    names = {c["name"] for c in CASES}
    assert MANIFEST["steps"] >= 10 and GRADS.shape == (2, MANIFEST["steps"], MANIFEST["n"])
    assert {"ef_onebit_scaling", "ef_onebit", "ef_topk_1", "ef_randomk_1", "ef_dithering_2_natural",
            "nesterov_ef_onebit_scaling"} <= names
    assert {c["name"] for c in CASES if c["server"]} >= {
        "server_nesterov_ef_onebit_scaling", "server_ef_topk_1", "server_ef_randomk_1",
        "server_ef_dithering_2_natural"}
    assert "-ffp-contract=off" in MANIFEST["build"], NO_FMA


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_step_matches_byteps(case):
    want_payloads, want_decoded = expected(case)
    got_payloads, got_decoded = our_steps(case)
    how = f" ({TOPK_HEAP_ORDER})" if case["params"]["compressor"] == "topk" else ""
    if case["params"].get("momentum"):
        how += f" ({NO_FMA})"
    for s, (got, want) in enumerate(zip(got_payloads, want_payloads)):
        assert same_payload(case["params"], got, want), f"{case['name']}: payload differs at step {s}{how}"
    for s, (got, want) in enumerate(zip(got_decoded, want_decoded)):
        assert got.tobytes() == want.tobytes(), f"{case['name']}: decoding differs at step {s}"


def test_the_state_matters_after_the_first_step():
    """The vectors would not catch a chain that forgets its error or momentum if every step's
    payload equalled the plain codec's: check that they do not."""
    by_name = {c["name"]: c for c in CASES}
    for name in ("ef_onebit_scaling", "nesterov_ef_onebit_scaling", "ef_topk_1"):
        case = by_name[name]
        bare = {k: v for k, v in case["params"].items() if k not in ("ef", "momentum", "mu")}
        plain = build_chain(bare, MANIFEST["n"], np.float32)
        payloads, _ = expected(case)
        later = [s for s in range(1, MANIFEST["steps"])
                 if not same_payload(bare, plain.compress(GRADS[0, s].copy(), CTX), payloads[s])]
        assert len(later) >= MANIFEST["steps"] - 2, f"{name}: the state changed only steps {later}"
