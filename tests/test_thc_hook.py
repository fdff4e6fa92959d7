"""thc through bps_gc.torch.comm_hook under DDP on 3 gloo ranks (torchrun): each bucket is two
all_reduces of float64 (the scale histograms, then the packed codes; hook_phased.py), no
all_gather, and every bucket's result equals the re-computation here from the three ranks'
bucket gradients: per-gradient chains (keys as the hook's), both phases summed with numpy."""
import numpy as np

from bps_gc.compress import build_chain
from bps_gc.torch.hook import bucket_key
from test_collective_hook import run

RANKS = 3
PARAMS = {"compressor": "thc", "bits": 4, "rotate": True, "feedback": True}


def expected_buckets(calls):
    state, results = {}, []
    for per_rank in zip(*calls):
        index, sizes = int(per_rank[0][0]), list(per_rank[0][1])
        if index not in state or state[index][0] != sizes:
            chains = [[build_chain(PARAMS, n, np.float32, key=bucket_key(index, i)) for _ in range(RANKS)]
                      for i, n in enumerate(sizes)]
            for codec in (c for per in chains for c in per):
                codec.set_summands(RANKS)
            state[index] = [sizes, chains, 0]
        ctx = {"lr": 0.1, "step": state[index][2]}
        state[index][2] += 1
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        result = np.empty(bounds[-1], np.float32)
        for i, chains in enumerate(state[index][1]):
            pieces = [grads[bounds[i]:bounds[i + 1]] for _, _, grads in per_rank]
            hist = np.sum([c.compress(x, ctx).view(np.float64) for c, x in zip(chains, pieces)], axis=0)
            codes = np.sum([c.compress_q(hist.view(np.uint8)).view(np.float64) for c in chains], axis=0)
            result[bounds[i]:bounds[i + 1]] = chains[0].finish(codes.view(np.uint8), None, RANKS) / np.float32(RANKS)
        results.append(result)
    return results


def test_hook_all_reduces_codes(tmp_path):
    run({"mode": "record", "steps": 3, "compression_params": PARAMS}, tmp_path, ranks=RANKS)
    saved = [np.load(tmp_path / f"hook{r}.npz") for r in range(RANKS)]
    count = len(saved[0]["index"])
    assert len(set(saved[0]["index"])) >= 2  # several buckets
    calls = [[(s["index"][i], s[f"sizes{i}"], s[f"in{i}"]) for i in range(count)] for s in saved]
    for rank, s in enumerate(saved):
        for i, value in enumerate(expected_buckets(calls)):
            assert s[f"out{i}"].tobytes() == value.tobytes(), f"rank {rank} call {i}"
