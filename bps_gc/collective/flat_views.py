"""Dense arrays that are views laid back to back in one flat buffer (a part of ``Buckets``), as
DDP's ``gradient_as_bucket_view`` lays out gradients (bps_gc.torch.flat_grads): a bucket's
arrays of one dtype that tile one stretch of memory in the order they were reduced, each
reduced in place, are all_reduced there, with no copy in or out. The all_reduce is the one a
copy into a kept buffer would send (the same elements in the same order, the same size), so
ranks laid out differently still issue the same collectives and sum the same numbers.
"""
import ctypes

import numpy as np
import torch


def address(array):
    """Where a numpy array's first element is."""
    return array.__array_interface__["data"][0]


def same_memory(a, b):
    """Whether flat arrays ``a`` and ``b`` are the same elements (a view of one another)."""
    return a.dtype == b.dtype and a.size == b.size and address(a) == address(b)


def start_of(wire):
    """Where a writable numpy array's first element is: ctypes' view of its buffer takes a third
    of the time of ``ctypes.data`` (one a dense array, every step: flat_views' main cost)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(wire)) if wire.nbytes else wire.ctypes.data


def in_place_region(entries):
    """The one flat array that the entries' ``wire`` arrays (flat, one dtype) tile back to back
    in their order, when each is reduced in place (its ``out`` is its wire); else None. Each
    element of it is an element of exactly one entry's memory, which the entries keep alive.
    An entry whose ``in_place`` says its wire is its output's memory (the caller's own array:
    writable, contiguous, of the wire's dtype) is checked for where it lies alone."""
    first = entries[0].wire
    start = end = first.ctypes.data
    for entry in entries:
        wire = entry.wire
        if entry.in_place:
            if start_of(wire) != end:
                return None
        else:
            out = entry.out
            if wire.ctypes.data != end or out.ctypes.data != end or out.nbytes != wire.nbytes or \
                    out.dtype != wire.dtype or not out.flags.c_contiguous or not wire.flags.writeable:
                return None
        end += wire.nbytes
    itemsize = first.dtype.itemsize
    return np.lib.stride_tricks.as_strided(first, shape=((end - start) // itemsize,), strides=(itemsize,))


def in_larger_buffer(array):
    """Whether ``array`` is a view into a larger buffer (a tensor's storage, or a numpy array's
    memory): a gradient laid out as a bucket view, which is fused with its neighbours in place
    rather than all_reduced alone."""
    root = array
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    if isinstance(root, torch.Tensor):
        return root.untyped_storage().nbytes() > array.nbytes
    return isinstance(root, np.ndarray) and root.nbytes > array.nbytes
