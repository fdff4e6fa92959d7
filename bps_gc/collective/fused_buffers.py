"""Flat buffers the buckets fuse their dense tensors into, kept for the next step (a part of
``Buckets``). A fresh 25 MB array each bucket costs its page faults and zeroing on every step
(about a third of a copy on the dev box); a step reduces the same buckets every time, so the
same sizes come back and their buffers are taken again, as DDP keeps its buckets.

What is kept is bounded: the free buffers never hold more bytes than were ever out at once (a
step's buckets), the least recently returned go first.
"""
import collections
import threading

import numpy as np


class FusedBuffers:
    """``take(dtype, n)``: a flat array of ``n`` elements, reused when one of that dtype and size
    is free; ``give(array)`` once the bucket delivered from it. Used from the exchange thread
    (take) and the caller's thread (give), under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.free = collections.OrderedDict()  # (dtype, n) -> [arrays], least recently given first
        self.free_bytes = self.out_bytes = self.most_out = 0

    def take(self, dtype, n):
        with self.lock:
            return self._take(np.dtype(dtype), n)

    def give(self, array):
        with self.lock:
            self._give(array)

    def _take(self, dtype, n):
        key = (dtype, n)
        arrays = self.free.get(key)
        if arrays:
            array = arrays.pop()
            if not arrays:
                del self.free[key]
            self.free_bytes -= array.nbytes
        else:
            array = np.empty(n, dtype)
        self.out_bytes += array.nbytes
        self.most_out = max(self.most_out, self.out_bytes)
        return array

    def _give(self, array):
        self.out_bytes -= array.nbytes
        key = (array.dtype, array.size)
        self.free.setdefault(key, []).append(array)
        self.free.move_to_end(key)
        self.free_bytes += array.nbytes
        while self.free_bytes > self.most_out:  # drop the least recently given
            oldest = next(iter(self.free))
            dropped = self.free[oldest].pop(0)
            if not self.free[oldest]:
                del self.free[oldest]
            self.free_bytes -= dropped.nbytes
