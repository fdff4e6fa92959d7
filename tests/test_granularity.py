"""Entire-model granularity in one process: the whole-vector payload cut into chunks decodes,
chunk by chunk with each chunk's own codec (what servers and pulls do), to a numpy
re-computation of the codec over the concatenated gradients; chunks spread over the servers."""
import dataclasses
import math

import numpy as np
import pytest

from bps_gc.algorithms.entire_model import chunk_bounds
from bps_gc.compress import CompressionParams, build_chain
from bps_gc.config import Config
from bps_gc.compress.entire_model import WholeVectorCodec, check_splittable
from bps_gc.comm.placement import Placement, TensorPlan, dense_partition_bytes
from test_codecs2_quantizers import qsgd_oracle, terngrad_oracle
from xorshift import XorShift128Plus

SHAPES = [(33, 7), (50,), (16, 16), (3,)]  # 540 elements: three chunks of a 1 KiB partition
PARTITION = 1024


def layers(rank):
    rng = np.random.default_rng(10 + rank)
    return [rng.standard_normal(s).astype(np.float32) * (i + 1) for i, s in enumerate(SHAPES)]


def topk(x, k):
    count = min(max(1, int(k * (-(-x.size // 32) * 32))), max(1, x.size // 2))
    out = np.zeros_like(x)
    idx = np.lexsort((np.arange(x.size), -np.abs(x)))[:count]  # ties to the lower index
    out[idx] = x[idx]
    return out


def randomk(x, k, seed):
    count = max(1, int(k * (-(-x.size // 32) * 32)))
    rng, out = XorShift128Plus(seed), np.zeros_like(x)
    for _ in range(count):
        i = rng.next() % x.size
        out[i] = x[i]
    return out


def signs(x, scale):
    return np.where(x < 0, -scale, scale).astype(np.float32)


def dgc_top(x, k):  # n = 540 <= ceil(2/k): every element is sampled, the threshold is exact
    count = math.ceil(x.size * k)
    out = np.zeros_like(x)
    idx = np.argsort(-np.abs(x), kind="stable")[:count]
    out[idx] = x[idx]
    return out


ORACLES = {  # numpy, never the codec
    "topk": ({"compressor": "topk", "k": 0.05}, lambda x: topk(x, 0.05)),
    "randomk": ({"compressor": "randomk", "k": 0.05, "seed": 99}, lambda x: randomk(x, 0.05, 99)),
    "threshold": ({"compressor": "threshold", "threshold": 2.0}, lambda x: np.where(np.abs(x) >= 2, x, 0)),
    "adaptive_threshold": ({"compressor": "adaptive_threshold"},
                           lambda x: np.where(np.abs(x) >= np.abs(x).max() / 2, x, 0)),
    "onebit": ({"compressor": "onebit"}, lambda x: signs(x, 1)),
    "onebit-scaling": ({"compressor": "onebit", "scaling": True},
                       lambda x: signs(x, np.float32(np.abs(x.astype(np.float64)).mean()))),
    "sign": ({"compressor": "sign"}, lambda x: signs(x, 1)),
    "signnorm": ({"compressor": "signnorm"}, lambda x: signs(x, np.float32(np.abs(x.astype(np.float64)).mean()))),
    "terngrad": ({"compressor": "terngrad", "seed": 5}, lambda x: terngrad_oracle(x, 5)),
    "qsgd": ({"compressor": "qsgd", "levels": 15, "seed": 6}, lambda x: qsgd_oracle(x, 6, 15)),
    "dgc": ({"compressor": "dgc", "k": 0.003}, lambda x: dgc_top(x, 0.003)),
}


def whole_model_sum(params, inputs, steps=1):
    """What a pull answers (lossless: the sum of the decoded chunks) for each step."""
    params = CompressionParams.from_dict(dict(params, granularity="entiremodel"))
    total = inputs[0][0].size
    bounds = chunk_bounds(total, 4, PARTITION)
    codecs = [WholeVectorCodec(params, total, np.float32, bounds, key=3) for _ in inputs]
    decoders = [build_chain(dict(params.to_dict(), ef=None), stop - start, np.float32, role="server")
                for start, stop in bounds]
    sums = []
    for step in range(steps):
        acc = np.zeros(total, np.float32)
        for codec, rank_inputs in zip(codecs, inputs):
            for (start, stop), payload, decoder in zip(bounds, codec.compress(rank_inputs[step], {}), decoders):
                decoder.decompress_add(payload, acc[start:stop])
        sums.append(acc)
    return sums, bounds


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_entire_model_equals_the_codec_over_the_concatenation(name):
    params, oracle = ORACLES[name]
    flat = [np.concatenate([g.reshape(-1) for g in layers(r)]) for r in range(2)]
    (got,), bounds = whole_model_sum(params, [[x] for x in flat])
    assert len(bounds) == 3
    want = np.zeros_like(got)
    for x in flat:
        want += oracle(x)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("params", [{"compressor": "dithering", "k": 3, "seed": 7},
                                    {"compressor": "dithering", "k": 4, "partition": "natural",
                                     "normalize": "l2", "seed": 7}])
def test_dithering_chunks_decode_to_the_whole_vector_codec(params):
    # the cut re-encodes each chunk's entries; the whole-vector codec is its own reference here
    x = np.concatenate([g.reshape(-1) for g in layers(0)])
    (got,), _ = whole_model_sum(params, [[x]])
    whole = build_chain(params, x.size, np.float32)
    assert np.array_equal(got, whole.decompress(whole.compress(x)))


def test_momentum_and_error_feedback_run_over_the_whole_vector():
    params = {"compressor": "topk", "k": 0.05, "ef": "vanilla", "momentum": "nesterov", "mu": 0.9}
    steps = [np.concatenate([g.reshape(-1) for g in layers(s)]) for s in range(3)]
    got, _ = whole_model_sum(params, [steps], steps=3)
    m, e = np.zeros_like(steps[0]), np.zeros_like(steps[0])
    for x, pulled in zip(steps, got):
        m = x + np.float32(0.9) * m
        g = x + np.float32(0.9) * m + e
        c = topk(g, 0.05)
        e = g - c
        assert np.array_equal(pulled, c)


def test_chunks_spread_over_the_servers():
    bounds = chunk_bounds(10_000, 4, 4096)
    assert len(bounds) == 10 and all(stop - start <= 1024 for start, stop in bounds)
    placement = Placement(2, 4096, 0)
    params = CompressionParams.from_dict({"compressor": "topk", "k": 0.01, "granularity": "entiremodel"})
    servers = []
    for i, (start, stop) in enumerate(bounds):
        tensor = placement.plan(TensorPlan(f"g.{i}", i, params, "lossless"), (stop - start,),
                                np.float32, lambda *a: (None, None), balanced=True)
        assert len(tensor.partitions) == 1
        servers.append(tensor.partitions[0].server)
    assert sorted(set(servers)) == [0, 1] and abs(placement.load[0] - placement.load[1]) <= 4096



def test_dense_partitions_are_cut_finer_than_compressed_ones():
    """BPS_GC_DENSE_PARTITION_BYTES caps uncompressed partitions only; codecs keep theirs."""
    placement = Placement(3, 4096, 0, dense_bytes=1024)
    dense = placement.plan(TensorPlan("d", 0, CompressionParams.from_dict({}), None), (2500,),
                           np.float32, lambda *a: (None, None), balanced=True)
    assert [(p.start, p.stop) for p in dense.partitions] == [(0, 256), (256, 512), (512, 768), (768, 1024),
                                                           (1024, 1280), (1280, 1536), (1536, 1792),
                                                           (1792, 2048), (2048, 2304), (2304, 2500)]
    assert [p.server for p in dense.partitions[:3]] == [0, 1, 2]
    topk = CompressionParams.from_dict({"compressor": "topk", "k": 0.01})
    compressed = placement.plan(TensorPlan("c", 1, topk, "lossless"), (2500,), np.float32,
                                lambda *a: (None, None), balanced=True)
    assert [(p.start, p.stop) for p in compressed.partitions] == [(0, 1024), (1024, 2048), (2048, 2500)]
    assert Placement(1, 4096, 0, dense_bytes=1 << 20).dense_bytes == 4096  # never above partition_bytes


def test_dense_partition_size_follows_the_hosts_unless_set():
    """Unset, BPS_GC_DENSE_PARTITION_BYTES is 1 MB for a job over several hosts and
    BYTEPS_PARTITION_BYTES for a job on one host; set, it is what it says."""
    one = {"servers": [{"address": "10.0.0.1:9001"}], "workers": [{"address": "10.0.0.1:9002"},
                                                                   {"address": "10.0.0.1:9003"}]}
    two = {"servers": one["servers"], "workers": [{"address": "10.0.0.1:9002"}, {"address": "10.0.0.2:9002"}]}
    cfg = Config.from_env({"DMLC_ROLE": "worker", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
                           "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000", "DMLC_WORKER_ID": "0"})
    assert (dense_partition_bytes(cfg, one), dense_partition_bytes(cfg, two)) == (4_096_000, 1_024_000)
    chosen = dataclasses.replace(cfg, dense_partition_bytes=8192)
    assert (dense_partition_bytes(chosen, one), dense_partition_bytes(chosen, two)) == (8192, 8192)

@pytest.mark.parametrize("params, words", [
    ({"compressor": "powersgd"}, "cannot cut 'powersgd'"),
    ({"compressor": "qsgd", "biased": True}, "tau"),
])
def test_codecs_that_cannot_be_cut_are_refused(params, words):
    with pytest.raises(ValueError, match=words):
        check_splittable(CompressionParams.from_dict(dict(params, granularity="entiremodel")))


def test_granularity_is_validated():
    with pytest.raises(ValueError, match="granularity.*'perlayer'"):
        CompressionParams.from_dict({"compressor": "topk", "k": 0.1, "granularity": "perlayer"})
    assert CompressionParams.from_dict({"compressor": "topk", "k": 0.1}).to_dict() == \
        {"compressor": "topk", "k": 0.1}  # layerwise, the default, is not written out
