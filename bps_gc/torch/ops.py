"""push_pull for torch tensors on top of the worker core.

Compressed tensors whose codecs run on their device (BPS_GC_DEVICE_CODECS, device.py)
are compressed and decoded there; only payloads reach the communicator. Otherwise CPU tensors
are handed to the core as numpy views of their own memory (no copy); other devices are staged
through a host copy and copied back when the handle is synchronized.
"""
import itertools

import numpy as np
import torch

import bps_gc.core as core

from .. import compress
from ..comm.placement import BFLOAT16, DtypeRefused  # wire/bfloat16.py's, as the communicator checks it
from .compression import Compression
from .device import DevicePushPull, device_partitions, reduces_dense_on_device, uses_device_chain

SUPPORTED = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
# numpy has no bfloat16: the servers sum it (wire/bfloat16.py), where no host sums it first
# (placement.check_dtype); elsewhere one says what to do instead
BFLOAT16_ELSEWHERE = ("keep the parameters float32 and train under torch.autocast(dtype=torch.bfloat16), or "
                      "use bps_gc.torch.comm_hook with DDP, which takes bfloat16 gradients")
UNSUPPORTED_HINT = ("float16, float32 and float64, and bfloat16 dense on the parameter server (no host's sum) "
                    f"only; for bfloat16 elsewhere {BFLOAT16_ELSEWHERE}")
_handles = {}
_next_handle = itertools.count()
_noname = itertools.count()

init, shutdown, rank, size = core.init, core.shutdown, core.rank, core.size
local_rank, local_size, barrier = core.local_rank, core.local_size, core.barrier


def _check(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED and tensor.dtype != torch.bfloat16:  # bfloat16: the communicator's check
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported: {UNSUPPORTED_HINT}")


def host_view(tensor):
    """(numpy array sharing the tensor's memory or a host copy, whether it is a copy); bfloat16
    as its bits (wire/bfloat16.py)."""
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t, staged = t.to("cpu", copy=True).contiguous(), True
    else:
        staged = False
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16), staged
    return t.numpy(), staged


def declare(name, shape=None, dtype=None, **compression_params):
    """Declare a tensor name (in the same order on every worker) with its compression; bfloat16
    only dense, where the servers sum it in float32 as pushed (wire/bfloat16.py): one_per_host,
    or every worker's on the parameter server when no host sums it (placement.check_dtype)."""
    if isinstance(dtype, torch.dtype) and dtype not in SUPPORTED and dtype != torch.bfloat16:
        raise TypeError(f"declare({name!r}): dtype {dtype} is not supported: {UNSUPPORTED_HINT}")
    np_dtype = numpy_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype
    try:
        return core.declare(name, shape=None if shape is None else tuple(shape), dtype=np_dtype,
                            **compression_params)
    except DtypeRefused as e:  # the communicator refuses bfloat16 here: say what else a torch user can do
        if dtype is not torch.bfloat16:
            raise
        raise TypeError(f"declare({name!r}): dtype torch.bfloat16 is not supported here: {e}; or "
                        f"{BFLOAT16_ELSEWHERE}") from None


def numpy_dtype(dtype):
    """The numpy dtype the core takes for torch ``dtype`` (bfloat16: wire/bfloat16.py's)."""
    return BFLOAT16 if dtype is torch.bfloat16 else SUPPORTED[dtype]


def _ensure_declared(name, tensor):
    if core.declaration(name) is None:
        declare(name, tuple(tensor.shape), tensor.dtype)


def push_pull_async(tensor, average=True, name=None, version=0, priority=0, lr=None, ctx=None):
    """Start summing (or averaging) ``tensor`` over all workers, in place; returns a handle.
    ``ctx``: the step context (lr, step, epoch, ...); ``lr`` a shortcut for its lr."""
    _check(tensor, "push_pull_async")
    name = name or f"push_pull.noname.{next(_noname)}"
    _ensure_declared(name, tensor)
    parts = device_partitions(name, tensor) if uses_device_chain(tensor) else None
    key = next(_next_handle)
    if parts:
        ctx = dict(compress.step_context(ctx))  # a copy: the caller may reuse its dict
        if lr is not None:
            ctx["lr"] = float(lr)
        _handles[key] = (DevicePushPull(tensor, name, parts, average, priority, ctx), tensor, None)
        return key
    if parts is not None and reduces_dense_on_device(name):  # torch.distributed: on the device
        _handles[key] = (core.communicator().reduce_tensor(tensor, name, average), tensor, None)
        return key
    array, staged = host_view(tensor)
    handle = core.push_pull(array, name, average=average, priority=priority, lr=lr, ctx=ctx)
    _handles[key] = (handle, tensor, array if staged else None)
    return key


def poll(handle):
    """True when the push_pull behind ``handle`` has finished."""
    if handle not in _handles:
        raise ValueError(f"poll: unknown handle {handle!r}")
    return _handles[handle][0].poll()


def end_group(handle):
    """BPS_GC_ELASTIC (docs/elastic.md): the round group of ``handle``'s push_pull ends now, on
    this thread, as a wait would end it; a no-op elsewhere."""
    if handle not in _handles:
        raise ValueError(f"end_group: unknown handle {handle!r}")
    _handles[handle][0].end_group()


def synchronize(handle):
    """Wait for ``handle``; returns its tensor, now holding the result."""
    if handle not in _handles:
        raise ValueError(f"synchronize: unknown handle {handle!r}")
    core_handle, tensor, staged = _handles.pop(handle)
    core_handle.wait()
    if staged is not None:
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(staged.view(np.int16)).view(torch.bfloat16) if staged.dtype == BFLOAT16
                         else torch.from_numpy(staged))
    return tensor


def push_pull_inplace(tensor, average=True, name=None, version=0, priority=0, lr=None, ctx=None):
    return synchronize(push_pull_async(tensor, average, name, version, priority, lr, ctx))


def push_pull(tensor, average=True, name=None, compression=None, priority=0, lr=None, ctx=None):
    """A new tensor with the sum (or mean) of ``tensor`` over all workers."""
    compression = compression or Compression.none
    _check(tensor, "push_pull")
    sent, restore = compression.compress(tensor.detach().clone())
    return compression.decompress(push_pull_inplace(sent, average, name, priority=priority, lr=lr, ctx=ctx),
                                  restore)
