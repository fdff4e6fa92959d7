"""Async mode, user errors and authentication on a real local cluster."""
import re
import sys
import textwrap

import pytest

from cluster import run_local

PRELUDE = textwrap.dedent("""
    import numpy as np, bps_gc.core as bps
    bps.init()
    r, n = bps.rank(), bps.size()
""")


def job(body, **kwargs):
    return run_local([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], **kwargs)


@pytest.mark.parametrize("params", [{}, {"compressor": "onebit", "scaling": True}],
                         ids=["dense", "onebit"])
def test_async_mode_applies_every_push(params):
    body = f"""
        params = {params!r}
        bps.declare("w", shape=(100_000,), dtype=np.float32, **params)
        steps = 5
        for step in range(steps):
            delta = np.full(100_000, float(r + 1), np.float32)
            bps.push_pull(delta, "w", average=False).wait()
        bps.barrier()
        final = bps.push_pull(np.zeros(100_000, np.float32), "w", average=False).wait()
        # every worker pushed (r + 1) five times; onebit with scaling sends +-mean|x| = the same
        expected = steps * sum(k + 1 for k in range(n))
        assert np.allclose(final, expected), (final[:4], expected)
        print("ASYNC-OK", final[0])
        bps.shutdown()
    """
    result = job(body, env={"BYTEPS_ENABLE_ASYNC": "1", "BYTEPS_MIN_COMPRESS_BYTES": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ASYNC-OK 15.0") == 2


def test_shape_mismatch_between_workers_is_a_clear_error():
    # whichever worker declares second is the offender and gets the error at its push_pull;
    # the other then sees its peer leave the job
    body = """
        import os
        n_elems = 10 if r == 0 else 11
        bps.declare("w", shape=(n_elems,), dtype=np.float32)
        try:
            bps.push_pull(np.ones(n_elems, np.float32), "w").wait()
        except ValueError as e:
            print("MISMATCH:", e, flush=True)
        except bps.NodeFailure as e:
            print("PEER-GONE:", e, flush=True)
        os._exit(0)
    """
    result = job(body, workers=2, servers=1, timeout=60)
    out = result.stdout
    assert re.search(r"MISMATCH: worker [01] declared key 0 \('w#0'\) differently from the first "
                     r"worker: (11 elements != 10|10 elements != 11)", out), out + result.stderr[-2000:]
    assert "PEER-GONE: worker" in out


def test_user_errors_at_the_call():
    body = """
        try:
            bps.push_pull(np.ones(3, np.float32), "nope")
        except KeyError as e:
            print("UNDECLARED:", e)
        bps.declare("w", compressor="topk", k=2)
        try:
            bps.declare("w", compressor="topk", k=3)
        except ValueError as e:
            print("CONFLICT:", e)
        try:
            bps.declare("v", shape=(4,), dtype=np.float32)
            bps.declare("v", shape=(5,), dtype=np.float32)
        except ValueError as e:
            print("RESHAPE:", e)
        try:
            bps.declare("x", compressor="zip")
        except ValueError as e:
            print("BADPARAM:", e)
        h = bps.push_pull(np.ones(1000, np.float32), "w")
        try:
            bps.push_pull(np.ones(1000, np.float32), "w")
        except RuntimeError as e:
            print("BUSY:", e)
        h.wait()
        try:
            bps.push_pull(np.ones(999, np.float32), "w")
        except ValueError as e:
            print("SHAPE:", e)
        bps.shutdown()
    """
    result = job(body, workers=1, servers=1, env={"BYTEPS_FORCE_DISTRIBUTED": "1"}, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "UNDECLARED: \"push_pull: 'nope' was not declared" in out
    assert "CONFLICT: declare: tensor 'w' was declared before differently: compression" in out
    assert "RESHAPE: declare: tensor 'v' was declared before differently: shape (5,) != (4,)" in out
    assert "BADPARAM: compression parameter 'compressor': unknown compressor 'zip'" in out
    assert "BUSY: push_pull('w') while the previous one is still running" in out
    assert "SHAPE: push_pull('w'): got (999,) float32, but it was first used as (1000,) float32" in out


def test_shared_token_lets_the_job_run():
    body = """
        bps.declare("w", shape=(5,), dtype=np.float32)
        print("TOKEN-OK", bps.push_pull(np.ones(5, np.float32), "w", average=False).wait()[0])
        bps.shutdown()
    """
    result = job(body, workers=2, servers=1, env={"BPS_GC_AUTH_TOKEN": "s3cret"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("TOKEN-OK 2.0") == 2


def test_local_cluster_with_one_worker_uses_its_servers():
    body = """
        bps.declare("w", shape=(4,), dtype=np.float32)
        print("ONE", bps.push_pull(np.ones(4, np.float32), "w", average=False).wait()[0], bps.metrics().pushed_raw)
        bps.shutdown()
    """
    result = job(body, workers=1, servers=2, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ONE 1.0 16" in result.stdout
