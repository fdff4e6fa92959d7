"""PowerSGD's numeric pieces: two phases of plain sums, full-rank reconstruction, error
feedback and warm start, against numpy."""
import numpy as np
import pytest

from bps_gc.compress import build_chain
from bps_gc.compress.powersgd import matrix_shape, orthogonalize


def run_step(codecs, inputs, ctx=None):
    """One PowerSGD step across workers, the runtime's two reduce phases done by hand."""
    p_sum = sum(np.frombuffer(c.compress(x, ctx).tobytes(), np.float32) for c, x in zip(codecs, inputs))
    p_bytes = p_sum.astype(np.float32).view(np.uint8)
    q_sum = sum(np.frombuffer(c.compress_q(p_bytes).tobytes(), np.float32) for c in codecs)
    q_bytes = q_sum.astype(np.float32).view(np.uint8)
    return [c.finish(q_bytes, workers=len(codecs)) for c in codecs]


@pytest.mark.parametrize("n", [1, 2, 10, 1000, 4097])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_full_rank_reconstructs_the_sum(n, workers):
    rows, cols = matrix_shape(n)
    assert rows * cols >= n and rows <= cols
    codecs = [build_chain({"compressor": "powersgd", "rank": rows, "seed": 7}, n, np.float32)
              for _ in range(workers)]
    rng = np.random.default_rng(n)
    inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(workers)]
    outs = run_step(codecs, inputs)
    total = np.sum(inputs, axis=0, dtype=np.float64)
    scale = np.abs(total).max() * max(rows, 1)
    for out in outs:
        assert np.allclose(out, total, rtol=0, atol=scale * 4e-7 * np.sqrt(rows))
        assert np.array_equal(out, outs[0])  # every worker decodes the same sum


def test_orthogonalize_gives_orthonormal_columns():
    p = np.random.default_rng(0).standard_normal((300, 4)).astype(np.float32)
    q = orthogonalize(p)
    assert np.allclose(q.T @ q, np.eye(4), atol=1e-5)
    assert np.allclose(q @ (q.T @ p), p, atol=1e-4)  # same column space


def test_rank_one_error_feedback_and_warm_start():
    n, workers = 400, 2
    codecs = [build_chain({"compressor": "powersgd", "rank": 1, "seed": 3}, n, np.float32)
              for _ in range(workers)]
    rng = np.random.default_rng(1)
    errors = [np.zeros(n, np.float32) for _ in range(workers)]
    q = codecs[0].q.copy()
    rows, cols = matrix_shape(n)
    for _ in range(3):
        inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(workers)]
        ms = []
        for x, e in zip(inputs, errors):
            m = np.zeros(rows * cols, np.float32)
            m[:n] = x + e
            ms.append(m.reshape(rows, cols))
        p_hat = np.linalg.qr(sum(m @ q for m in ms))[0]
        q = sum(m.T @ p_hat for m in ms)
        approx = (p_hat @ q.T).reshape(-1)[:n]
        errors = [m.reshape(-1)[:n] - approx / workers for m in ms]
        outs = run_step(codecs, inputs)
        assert np.allclose(outs[0], approx, atol=1e-4)
        for c, e in zip(codecs, errors):
            assert np.allclose(c.error, e, atol=1e-4)
        assert np.allclose(codecs[0].q, q, atol=1e-4)  # the next step starts from this Q
    # what was not sent is in the errors: sent + errors = everything that went in
    assert np.abs(codecs[0].error).max() > 0


def test_float16_partition_and_combined_decompress():
    n = 50
    codec = build_chain({"compressor": "powersgd", "rank": 8, "seed": 1}, n, np.float16)
    assert codec.rank == 7  # full rank of the 7 x 8 view
    x = np.linspace(-1, 1, n).astype(np.float16)
    p = codec.compress(x)
    q = codec.compress_q(p)
    out = codec.finish(q)
    assert out.dtype == np.float16 and np.allclose(out, x, atol=2e-3)
    assert np.allclose(codec.decompress(np.concatenate([orthogonalize(
        np.frombuffer(p.tobytes(), np.float32).reshape(-1, codec.rank)).view(np.uint8).reshape(-1), q])), x, atol=2e-3)
