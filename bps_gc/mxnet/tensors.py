"""NDArray <-> numpy for the worker core: a zero-copy view of a CPU NDArray's memory.

The worker core reads and writes numpy arrays in place. On CPU we hand it the NDArray's own
buffer (``MXNDArrayGetData``) once MXNet's engine has finished every pending operation on it;
MXNet then sees our writes because nothing else touches the array until we return. Arrays that
cannot be viewed (other devices, sparse storage, a oneDNN-specific layout) go through
``asnumpy`` and are copied back by ``commit()``.
"""
import ctypes

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, MXNetError, check_call

CPU_DEVICES = ("cpu", "cpu_pinned", "cpu_shared")


class HostArray:
    """``array``: numpy access to ``nd``; call ``commit()`` after writing to it."""

    __slots__ = ("nd", "array", "copied")

    def __init__(self, nd, write=True):
        if not isinstance(nd, mx.nd.NDArray):
            raise TypeError(f"expected an mxnet NDArray, got {type(nd).__name__}")
        self.nd = nd  # keeps the memory the view points into alive
        view = _view(nd, write)
        self.copied = view is None
        self.array = nd.asnumpy() if view is None else view

    def commit(self):
        """Make what was written into ``array`` visible in the NDArray (a no-op for views)."""
        if self.copied:
            self.nd[:] = self.array


def _view(nd, write):
    if nd.context.device_type not in CPU_DEVICES or nd.stype != "default":
        return None
    dtype = np.dtype(nd.dtype)
    count = int(np.prod(nd.shape))
    if count == 0:
        return None
    if write:  # every pending read and write of the array is done
        check_call(_LIB.MXNDArrayWaitToWrite(nd.handle))
    else:
        nd.wait_to_read()
    pointer = ctypes.c_void_p()
    try:
        check_call(_LIB.MXNDArrayGetData(nd.handle, ctypes.byref(pointer)))
    except MXNetError:  # e.g. data in a oneDNN layout: no plain buffer to view
        return None
    if not pointer.value:
        return None
    buffer = (ctypes.c_char * (count * dtype.itemsize)).from_address(pointer.value)
    return np.frombuffer(buffer, dtype).reshape(nd.shape)
