"""Scratch buffers shared by the codecs of many partitions: the arrays a codec needs only inside
one call (error feedback's g, a server's sum of the pushes, a decoded payload to add or
subtract) and holds nothing in between.

Without one, each codec keeps its own (a spare the size of its partition, reused every step:
no allocation a step). A caller that runs many partitions' codecs one after another on one
thread (the exchange's pipeline: FSDP2's shards, docs/fsdp.md "Bytes and memory per codec")
hands them one ``Scratch`` instead (``use_scratch``): one buffer per slot, the size of the
largest partition, which the caller frees (``release``) once a call's partitions are done, so
what the codecs hold between steps is their state alone (at an allocation per call, not per
partition), or keeps for the next call (``kept``: the DDP hook's buckets, docs/ddp_hook.md
"Memory"). A thread that asks gets buffers of its own, so codecs that run on two threads (the
pipeline's compressing and reducing threads) never share one."""
import threading

import numpy as np


class Scratch:
    """Named slots of flat arrays, each grown to the largest request (per thread). ``kept``: the
    caller keeps them across calls (never ``release``s): error feedback then keeps a second
    buffer of its own to swap with e, where a shared one would cost a copy of g into e every
    step (~10% of onebit+EF's step in a draft measured with scripts/ddp_hook_memory.py) to save
    memory that a kept buffer does not save."""

    def __init__(self, kept=False):
        self.buffers = {}  # (slot, thread id) -> its array (a slot: a name and a dtype, or more)
        self.kept = kept

    def take(self, slot, n, dtype):
        """The first ``n`` elements of ``slot``'s ``dtype`` array (contents undefined): valid
        until the next ``take`` of the same slot on this thread."""
        dtype = np.dtype(dtype)
        return self.take_made((slot, dtype), n, lambda size: np.empty(size, dtype))

    def take_made(self, slot, n, make):
        """``take`` of any flat buffer: ``make(size)`` makes one (a device codec's torch tensor,
        compress/device/base.py ``shared_tensor``); ``slot`` names what it is (its dtype and
        device too). One per thread, so per pipeline stage and so per CUDA stream."""
        key = (slot, threading.get_ident())
        buffer = self.buffers.get(key)
        if buffer is None or len(buffer) < n:
            buffer = self.buffers[key] = make(n)
        return buffer[:n]

    def release(self):
        """Drop every buffer (an array still in use stays valid: it is only no longer reused)."""
        self.buffers.clear()

    def nbytes(self):
        return sum(b.nbytes if isinstance(b, np.ndarray) else b.numel() * b.element_size()
                   for b in list(self.buffers.values()))


def lends_g(scratch):
    """Whether error feedback builds g in ``scratch`` (then copies it into e) rather than in a
    second buffer of its own (swapped with e): only a scratch freed after each call saves
    memory that way; a kept one would only add the copy (``Scratch``)."""
    return scratch is not None and not scratch.kept


def use_scratch(codec, scratch):
    """Hand ``scratch`` to ``codec`` (a chain or a reducer) and to every codec inside it (a
    decorator's wrapped codec, a reducer's chains), each made or to be made."""
    seen, todo = set(), [codec]
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if hasattr(obj, "scratch"):
            obj.scratch = scratch
        todo.extend(getattr(obj, name, None) for name in ("inner", "_chain", "_decoder"))
