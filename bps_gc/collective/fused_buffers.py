"""Flat buffers the buckets fuse their dense tensors into, kept for the next step (a part of
``Buckets``). A fresh 25 MB array each bucket costs its page faults and zeroing on every step
(about a third of a copy on the dev box); a step reduces the same buckets every time, so the
same sizes come back and their buffers are taken again, as DDP keeps its buckets.

What is kept is bounded: the free buffers never hold more bytes than a step's buckets took
(the most taken between two moments when none was out: a step's first buckets are given back
while its last are taken, so fewer are out at once than it uses) or than were ever out at once;
the least recently returned go first.
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
        self.taken_since_idle = self.most_taken = 0  # bytes taken since none was out; their most

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
        self.taken_since_idle += array.nbytes
        return array

    def _give(self, array):
        self.out_bytes -= array.nbytes
        if self.out_bytes == 0:  # a step's buckets all delivered: what it took, kept for the next
            self.most_taken = max(self.most_taken, self.taken_since_idle)
            self.taken_since_idle = 0
        key = (array.dtype, array.size)
        self.free.setdefault(key, []).append(array)
        self.free.move_to_end(key)
        self.free_bytes += array.nbytes
        while self.free_bytes > max(self.most_out, self.most_taken):  # drop the least recently given
            oldest = next(iter(self.free))
            dropped = self.free[oldest].pop(0)
            if not self.free[oldest]:
                del self.free[oldest]
            self.free_bytes -= dropped.nbytes
