"""thc through bps_gc.torch.comm_hook under DDP on 3 gloo ranks (bpslaunch --servers 0): each bucket is two
all_reduces of int64 words (the scale histograms, then the packed codes; collective/exchange/phased.py), no
all_gather, and every bucket's result equals the re-computation here from the three ranks'
bucket gradients: per-parameter chains (keys as the hook's, kept when DDP regroups), both
phases summed with numpy."""
import json

import numpy as np

from bps_gc.compress import build_chain
from bps_gc.collective.exchange.codecs import bucket_key
from test_collective_hook import run

RANKS = 3
PARAMS = {"compressor": "thc", "bits": 4, "rotate": True, "feedback": True}


def expected_buckets(calls):
    """calls[r] = [(index, sizes, gradients, parameters)]: each parameter's chains are made where
    it was first seen (keyed by that bucket index and position) and kept when DDP regroups; a
    bucket's step is one more than the most its gradients were reduced (collective/exchange/codecs.py)."""
    chains, steps, results = {}, {}, []
    for per_rank in zip(*calls):
        index, sizes, owners = int(per_rank[0][0]), list(per_rank[0][1]), [int(p) for p in per_rank[0][3]]
        for i, (n, owner) in enumerate(zip(sizes, owners)):
            if owner not in chains or chains[owner][0].n != n:
                chains[owner] = [build_chain(PARAMS, n, np.float32, key=bucket_key(index, i)) for _ in range(RANKS)]
                for codec in chains[owner]:
                    codec.set_summands(RANKS)
                steps[owner] = 0
        step = max(steps[owner] for owner in owners)
        steps.update((owner, step + 1) for owner in owners)
        ctx = {"lr": 0.1, "step": step}
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        result = np.empty(bounds[-1], np.float32)
        for i, owner in enumerate(owners):
            per = chains[owner]
            pieces = [grads[bounds[i]:bounds[i + 1]] for _, _, grads, _ in per_rank]
            hist = np.sum([c.compress(x, ctx).view(np.float64) for c, x in zip(per, pieces)], axis=0)
            codes = np.sum([c.compress_q(hist.view(np.uint8)).view(np.float64) for c in per], axis=0)
            result[bounds[i]:bounds[i + 1]] = per[0].finish(codes.view(np.uint8), None, RANKS) / np.float32(RANKS)
        results.append(result)
    return results


def test_hook_all_reduces_codes(tmp_path):
    run({"mode": "record", "steps": 3, "compression_params": PARAMS}, tmp_path, ranks=RANKS)
    saved = [np.load(tmp_path / f"hook{r}.npz") for r in range(RANKS)]
    count = len(saved[0]["index"])
    assert len(set(saved[0]["index"])) >= 2  # several buckets
    calls = [[(s["index"][i], s[f"sizes{i}"], s[f"in{i}"], s[f"params{i}"]) for i in range(count)] for s in saved]
    for rank, s in enumerate(saved):
        for i, value in enumerate(expected_buckets(calls)):
            assert s[f"out{i}"].tobytes() == value.tobytes(), f"rank {rank} call {i}"
    # its codecs are the hook's per-gradient ones: saved by parameter name (no reducer: the
    # phases are all_reduces), each reduced once per step
    state = json.loads((tmp_path / "codec_state0.json").read_text())
    for p in range(4):
        assert state[f"param.{p}/steps"] == 3, p
        assert any(k.startswith(f"param.{p}/worker/") for k in state), p
    assert not any("/reducer/" in k for k in state)
