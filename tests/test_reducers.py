"""Reducers in one process against numpy: reply sizes and formats, the dense/sparse switch of
lossless, majority's ties and non-finite pushes, and what declare refuses."""
import numpy as np
import pytest

from bps_gc.compress import (REDUCERS, CompressionParams, build_chain, choose_reducer,
                             make_reducer, register_reducer)


def payloads(params, xs, key=0):
    return [build_chain(params, x.size, x.dtype, key=key).compress(x) for x in xs]


@pytest.mark.parametrize("dtype, record", [(np.float32, 8), (np.float16, 6), (np.float64, 12)])
def test_lossless_answers_records_while_shorter_than_dense(dtype, record):
    n = 1000
    params = CompressionParams.from_dict({"compressor": "topk", "k": 10})
    xs = [np.zeros(n, dtype) for _ in range(3)]
    for r, x in enumerate(xs):
        x[r * 10:(r + 1) * 10] = np.arange(1, 11) * (r + 1)
    reducer = make_reducer("lossless", params, n, dtype)
    reply = reducer.reduce(payloads(params, xs), True)
    assert reply.nbytes == 30 * record
    out = np.full(n, 7, dtype)
    reducer.decode(reply, out)
    assert np.array_equal(out, xs[0] + xs[1] + xs[2])


def test_lossless_answers_dense_once_records_would_be_longer():
    n = 64
    params = CompressionParams.from_dict({"compressor": "topk", "k": 32})
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    reducer = make_reducer("lossless", params, n, np.float32)
    reply = reducer.reduce(payloads(params, xs), True)
    assert reply.nbytes == n * 4  # > 32 nonzeros * 8 bytes would not be shorter
    decoded = [build_chain(params, n, np.float32).decompress(p) for p in payloads(params, xs)]
    out = np.empty(n, np.float32)
    assert np.array_equal(reducer.decode(reply, out), np.zeros(n, np.float32) + decoded[0] + decoded[1])
    with pytest.raises(ValueError, match="neither"):
        reducer.decode(reply[:-3], out)


def test_majority_votes_one_bit_per_element_and_ties_go_positive():
    n = 13
    params = CompressionParams.from_dict({"compressor": "onebit", "scaling": True})
    xs = [np.array([1, -1, 1, -1, 2, -3, 1, 1, -1, 0.5, -0.5, 1, -1], np.float32),
          np.array([1, -1, -1, 1, 2, -3, -1, 1, -1, 0.5, -0.5, -1, 1], np.float32),
          np.array([-1, 1, -1, 1, 2, 3, 1, 1, 1, 0.5, 0.5, 1, -1], np.float32),
          np.array([1, 1, 1, 1, -2, 3, -1, -1, -1, -0.5, -0.5, -1, 1], np.float32)]
    reducer = make_reducer("majority", params, n, np.float32)
    reply = reducer.reduce(payloads(params, xs), True)
    assert reply.nbytes == 2 + 1
    votes = sum(np.sign(x) for x in xs)
    out = np.empty(n, np.float32)
    assert np.array_equal(reducer.decode(reply, out), np.where(votes < 0, -1, 1).astype(np.float32))
    assert not reducer.summed


def test_majority_reports_a_non_finite_push_as_nan():
    params = CompressionParams.from_dict({"compressor": "onebit"})
    xs = [np.ones(20, np.float32), np.ones(20, np.float32)]
    raw = [x.view(np.uint8) for x in xs]
    xs[1][3] = np.inf
    reducer = make_reducer("majority", params, 20, np.float32)
    out = reducer.decode(reducer.reduce(raw, False), np.empty(20, np.float32))
    assert np.isnan(out).all()


def test_recompress_is_decode_sum_recode_with_the_server_chain():
    n = 500
    params = CompressionParams.from_dict({"compressor": "topk", "k": 5, "ef": "vanilla"})
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    ps = payloads(params, xs, key=3)
    reducer = make_reducer("recompress", params, n, np.float32, key=3)
    server = build_chain(params, n, np.float32, key=3, role="server")
    acc = np.zeros(n, np.float32) + server.decompress(ps[0]) + server.decompress(ps[1])
    expected = server.compress(acc, {"lr": 0.1})
    reply = reducer.reduce(ps, True, {"lr": 0.1})
    assert reply.tobytes() == expected.tobytes()


def test_codecs_choose_and_refuse_reducers():
    topk = CompressionParams.from_dict({"compressor": "topk", "k": 3})
    onebit = CompressionParams.from_dict({"compressor": "onebit"})
    assert choose_reducer(topk) == "recompress"
    assert choose_reducer(onebit, "majority") == "majority"
    assert choose_reducer(CompressionParams.from_dict({})) == "sum"
    with pytest.raises(ValueError, match="compressor 'topk' does not support reducer 'majority'"):
        choose_reducer(topk, "majority")
    with pytest.raises(ValueError, match="unknown reducer 'mean'"):
        choose_reducer(topk, "mean")
    with pytest.raises(ValueError, match="already registered"):
        register_reducer("lossless")(REDUCERS["majority"])
