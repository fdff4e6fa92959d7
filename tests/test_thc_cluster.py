"""thc on real clusters: the parameter server (3 hosts x 2 ranks, two levels and flat, one
bpslaunch per role) and torch.distributed (2 hosts x 3 ranks, two levels, one bpslaunch per
host), each host a network namespace. The servers and the all_reduce add the packed codes as
int64 words; every rank's pull is decoded from those sums. The oracle recomputes the codes
here with numpy (nearest rounding, ties up, with error feedback, so they are deterministic):
one per rank when flat; with two levels one per host, of the host's float32 sum in local-rank
order (comm/phased.py ``host_first``). It sums them as int64 and decodes by the stated formula:
the pulls must equal it bit for bit, and the integer sums read back from the pulls must equal
numpy's. A stochastic 2-bit tensor rides along: every rank pulls the same values, within the
stated bound of the true mean; so does an 8-bit one with float16 on the wire (the host's sum
cast for its owner's codec and the decoded sum cast back), within a code step of the mean."""
import math

import numpy as np
import pytest

from collective_hosts import run_spec as run_collective
from local_ranks import machines, run_spec  # noqa: F401
from reference import gradient, partitions

EXACT = {"name": "thc4", "shape": [1100], "dtype": "float32",
         "params": {"compressor": "thc", "bits": 4, "feedback": True}}
EIGHT = {"name": "thc8", "shape": [700], "dtype": "float32",
         "params": {"compressor": "thc", "bits": 8, "feedback": True}}
RANDOM = {"name": "thc2", "shape": [900], "dtype": "float32",
          "params": {"compressor": "thc", "bits": 2, "rotate": True}}
HALF = {"name": "thc16", "shape": [600], "dtype": "float32",  # float16 on the wire
        "params": {"compressor": "thc", "bits": 8, "feedback": True, "fp16": True}}
SPEC = {"steps": 2, "lrs": [0.1, 0.05], "partition_bytes": 2048, "min_compress_bytes": 0,
        "tensors": [EXACT, EIGHT, RANDOM, HALF,
                    {"name": "dense", "shape": [300], "dtype": "float32", "params": {}}]}


def pushed(tensor, step, ranks, local_size):
    """What is encoded: each rank's gradient (flat), or each host's float32 sum in local-rank order."""
    grads = [gradient(r, step, tensor).reshape(-1).astype(np.float32) for r in range(ranks)]
    hosts = []
    for first in range(0, ranks, local_size):
        total = grads[first].copy()
        for g in grads[first + 1:first + local_size]:
            total += g
        hosts.append(total)
    return np.array(hosts, np.float32)


def integer_sums(tensor, ranks, steps, partition_bytes, local_size=1):
    """Per step: (numpy's int64 sums of every summand's codes, the exponents, the averaged pull),
    the codes recomputed with error feedback from each rank's (or host's) gradients."""
    bits = tensor["params"]["bits"]
    levels = 2**bits - 1
    size = int(np.prod(tensor["shape"]))
    summands = ranks // local_size
    errors = np.zeros((summands, size), np.float32)
    out = []
    for step in range(steps):
        xs = pushed(tensor, step, ranks, local_size) + errors
        total, pulled, exponents = np.zeros(size, np.int64), np.empty(size, np.float32), []
        for _, start, stop in partitions(size, np.float32, partition_bytes):
            part = xs[:, start:stop]
            exponent = max(math.ceil(math.log2(float(np.abs(p).max()))) for p in part)
            codes = np.clip(np.floor((part.astype(np.float64) / 2.0**exponent + 1) * levels / 2 + 0.5), 0,
                            levels).astype(np.int64)  # to the nearest, ties up
            errors[:, start:stop] = part - (2.0**exponent * (2.0 * codes / levels - 1)).astype(np.float32)
            total[start:stop] = codes.sum(axis=0)
            pulled[start:stop] = (2.0**exponent * (2.0 * total[start:stop] / levels - summands)).astype(np.float32)
            exponents.append((start, stop, exponent))
        out.append((total, exponents, pulled / np.float32(ranks)))
    return out


def codes_of(pull, exponents, bits, ranks, summands):
    """The integer sums a pull (averaged over ``ranks``) was decoded from: Q = (N_r pull / s + N) M / 2,
    rounded, for N summands."""
    levels = 2**bits - 1
    q = np.empty(pull.size, np.int64)
    for start, stop, exponent in exponents:
        q[start:stop] = np.rint((pull[start:stop].astype(np.float64) * ranks / 2.0**exponent + summands) * levels / 2)
    return q


def check(got, ranks, local_size=1):
    for tensor in (EXACT, EIGHT):
        sums = integer_sums(tensor, ranks, SPEC["steps"], SPEC["partition_bytes"], local_size)
        for step, (total, exponents, pulled) in enumerate(sums):
            key = f"{tensor['name']}/{step}"
            for rank in range(ranks):
                assert got[rank][key].tobytes() == pulled.tobytes(), \
                    f"rank {rank} {key}: max diff {np.abs(got[rank][key] - pulled).max()}"
            np.testing.assert_array_equal(
                codes_of(got[0][key], exponents, tensor["params"]["bits"], ranks, ranks // local_size), total)
    for step in range(SPEC["steps"]):
        key = f"thc2/{step}"
        mean = np.mean([gradient(r, step, RANDOM) for r in range(ranks)], axis=0)
        assert all(got[r][key].tobytes() == got[0][key].tobytes() for r in range(ranks))
        # each of a rank's (at most 1,024 rotated) codes errs by under one step 2 s / M, and
        # the shared scale s < 2 max |rotated x| <= 2 max ||x||_2 (the rotation keeps 2-norms);
        # with host sums, H codes err, s < 2 L max ||x||_2, and the mean divides by H L: the same bound
        scale = 2 * max(np.linalg.norm(gradient(r, step, RANDOM)) for r in range(ranks))
        assert 0 < np.linalg.norm(got[0][key] - mean) < 2 * scale / 3 * math.sqrt(1024)
        # float16 on the wire: every rank pulls the same values, each within the float16
        # rounding of the inputs plus N half-steps of 8-bit codes of the mean
        key = f"thc16/{step}"
        grads = [gradient(r, step, HALF).reshape(-1) for r in range(ranks)]
        mean = np.mean(grads, axis=0)
        assert all(got[r][key].tobytes() == got[0][key].tobytes() for r in range(ranks))
        step_size = 2 * 2.0 ** math.ceil(math.log2(ranks * max(np.abs(g).max() for g in grads))) / 255
        assert np.abs(got[0][key] - mean).max() < step_size + 1e-3 * np.abs(mean).max() + 1e-6


@pytest.mark.parametrize("hierarchy", ["host", "flat"])
def test_parameter_server_adds_codes(machines, tmp_path, hierarchy):  # noqa: F811
    got = run_spec(machines, SPEC, tmp_path, hosts=3, local_size=2, servers=2,
                   env={"BPS_GC_HIERARCHY": hierarchy})
    check(got, 6, 2 if hierarchy == "host" else 1)


def test_all_reduce_adds_codes(machines, tmp_path):  # noqa: F811
    got = run_collective(machines, SPEC, tmp_path, hosts=2, local_size=3, launcher="bpslaunch")
    check(got, 6, 3)
