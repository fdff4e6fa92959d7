"""The compressed exchange's stages, written once for every caller on torch.distributed: the
collective's buckets and its two levels, the DDP hook (on its three threads) and push_pull
through device chains. Only the exchange's driver (exchange/driver.py) calls them, in its one
sequence; callers hand it jobs or call its stages.

    compress_parts    each named part of a flat buffer -> its payload (the part's worker chain)
    exchange_payloads every rank's payloads, in rank order (one all_gather on the given group:
                      all_gather.py; or, with each part's destination, an all_to_all that
                      hands a rank only the parts it reduces: all_to_all.py)
    reduce_parts      each part's reducer over every rank's payloads, decoded into the buffer,
                      divided where the reducer sums

A part is anything with ``start``, ``stop``, ``codec`` (the worker chain; None for a part this
rank reduces alone and sums exactly, whose own payload is its values: ``Exact``) and ``reducer``
(the reduction the parameter server would run): the collective's placement partitions, or
``CodedPart`` where the caller names its pieces itself (a DDP bucket's gradients, two levels'
owned pieces). Flat buffers are numpy arrays (numpy chains and reducers) or torch tensors
(device chains, whose reducers reduce straight into the buffer).
"""
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from .all_gather import Capacity, PayloadsMissing, all_gather_bytes, all_gather_tensors, payload_bytes
from .all_to_all import all_to_all_bytes

# the words two-phase codecs sum in here (thc): gloo and NCCL add int64 exactly (modulo 2^64),
# all 64 bits of a word where float64 adds 53
WORDS = np.dtype(np.int64)


class CodedPart(NamedTuple):
    """Elements [start, stop) of a flat buffer, compressed by ``codec`` and reduced by
    ``reducer``; ``ctx`` the step context its codec sees (None: the caller's); ``owner`` the
    local rank that sums, encodes and decodes it under two levels; ``name`` what its codec
    state is kept under (for messages)."""
    start: int
    stop: int
    codec: Any
    reducer: Any
    ctx: Optional[dict] = None
    owner: int = 0
    name: str = ""


class Exact(NamedTuple):
    """This rank's own payload of a part it reduces alone with an exact sum (Pipeline.reduce_at):
    a copy of its values, which join the sum as they are. They never leave the rank, so a codec
    would only add its error to them (and keep a residual for it)."""
    values: Any


def compress_parts(parts, flat, ctx=None):
    """This rank's payload of each part of ``flat``, in order."""
    return [Exact(_copy(flat[part.start:part.stop])) if part.codec is None else
            part.codec.compress(flat[part.start:part.stop], part.ctx if ctx is None else ctx) for part in parts]


def _copy(values):
    return values.clone() if isinstance(values, torch.Tensor) else values.copy()


def exchange_payloads(payloads, wait, group=None, parts=None, capacity=None, device=None, destinations=None):
    """Every rank's payloads in rank order (``payloads`` None: this rank failed to make its
    ``parts`` payloads; every rank then raises PayloadsMissing). Host payloads travel as bytes
    (``capacity``: all_gather.Capacity, one collective once the sizes are known), device ones
    stay on their ``device``. ``destinations`` (each part's rank in ``group``, the one that
    reduces it): each payload goes to that rank alone (an all_to_all), and the others' lists
    hold None in its place."""
    if destinations is not None:
        return all_to_all_bytes(payloads, destinations, wait, group, capacity, device)
    on_device = device is not None or bool(payloads) and isinstance(payloads[0], torch.Tensor)
    if on_device:
        return all_gather_tensors(payloads, wait, group, parts, device)
    return all_gather_bytes(payloads, wait, group, parts, capacity)


def reduce_parts(parts, gathered, flat, ctx=None, divisor=None):
    """Each part's reduction of every rank's payloads (``gathered``: per rank, a payload per
    part, in order) decoded into its slice of ``flat``, then divided by ``divisor`` where the
    reducer's result is a sum (a majority vote is not averaged). A part without a reducer, or
    whose payloads went to another rank (None), is reduced there (Pipeline.reduce_at): its
    slice of ``flat`` is not written. A part whose payload from this rank is ``Exact`` sums its
    values first, then the others' decoded payloads in rank order."""
    on_device = isinstance(flat, torch.Tensor)
    for index, part in enumerate(parts):
        if part.reducer is None:
            continue
        payloads = [rank[index] for rank in gathered]
        if payloads[0] is None:  # sent to the rank that reduces it (a reducer loaded from an old state)
            continue
        chunk, step = flat[part.start:part.stop], part.ctx if ctx is None else ctx
        # only a part without a chain has an Exact payload: the scan stays off every other part's path
        exact = None if part.codec is not None else next((p for p in payloads if isinstance(p, Exact)), None)
        if exact is not None:
            acc = exact.values
            for payload in payloads:
                if payload is not exact:
                    part.reducer.decoder.decompress_add(payload, acc)
            if on_device:
                chunk.copy_(acc)
            else:
                np.copyto(chunk, acc)
        elif on_device:
            part.reducer.reduce(payloads, chunk, step)
        else:
            part.reducer.decode(part.reducer.reduce(payloads, True, step), chunk, step)
        if divisor is not None and part.reducer.summed:
            chunk /= divisor if on_device else chunk.dtype.type(divisor)
    return flat


def in_wire_dtype(flat, parts, wire_dtype):
    """``flat`` (numpy) as the codecs' ``wire_dtype``: itself when it is already, else a copy in
    which only ``parts`` are cast (fp16 codecs see the host's float32 sums; only this rank's
    parts are encoded and decoded). ``back(wired)`` copies the parts' results into ``flat``."""
    if flat.dtype == wire_dtype:
        return flat, lambda wired: None
    wired = np.empty(flat.size, wire_dtype)
    for part in parts:
        wired[part.start:part.stop] = flat[part.start:part.stop]

    def back(result):
        for part in parts:
            flat[part.start:part.stop] = result[part.start:part.stop]
    return wired, back


__all__ = ["WORDS", "Capacity", "CodedPart", "Exact", "PayloadsMissing", "compress_parts", "exchange_payloads",
           "in_wire_dtype", "payload_bytes", "reduce_parts"]
