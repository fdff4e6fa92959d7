"""The collective's kept bucket buffers (bps_gc/collective/fused_buffers.py): a step's buckets
get back the memory the last step's used, even when its first buckets were given back before
its last were taken, and what is kept never exceeds what a step took or the most ever out at
once. (The results through them: tests/test_collective_exact.py, several steps.)"""
import numpy as np

from bps_gc.collective.fused_buffers import FusedBuffers


def test_a_steps_buckets_reuse_the_last_steps_memory():
    pool = FusedBuffers()
    first = [pool.take(np.float32, n) for n in (1000, 2000, 1000)]
    for array in first:
        pool.give(array)
    second = [pool.take(np.float32, n) for n in (1000, 2000, 1000)]
    assert {a.ctypes.data for a in second} == {a.ctypes.data for a in first}
    assert pool.take(np.float16, 1000).ctypes.data not in {a.ctypes.data for a in first}  # another dtype: new


def test_a_step_given_back_while_taking_keeps_all_its_buffers():
    """As the exchange thread takes a step's later buckets while the caller delivers its first:
    never all out at once, yet the next step finds every one (none faulted in anew)."""
    pool = FusedBuffers()
    a, b = pool.take(np.float32, 1000), pool.take(np.float32, 2000)
    pool.give(a)
    c = pool.take(np.float32, 3000)
    pool.give(b)
    pool.give(c)
    assert pool.most_out == 4 * 5000 < pool.free_bytes == 4 * 6000
    again = [pool.take(np.float32, n) for n in (1000, 2000, 3000)]
    assert [x.ctypes.data for x in again] == [x.ctypes.data for x in (a, b, c)]


def test_kept_bytes_never_exceed_the_most_out_at_once():
    pool = FusedBuffers()
    for n in range(100, 200):  # sizes that never come back, one out at a time
        pool.give(pool.take(np.float32, n))
        assert pool.free_bytes <= pool.most_out == 4 * n
    assert sum(a.nbytes for arrays in pool.free.values() for a in arrays) == pool.free_bytes == 4 * 199
