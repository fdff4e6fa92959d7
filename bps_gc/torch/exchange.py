"""The compressed exchange for callers that are not DDP: named tensors averaged over any process
group, through the same pipeline as the DDP hook (collective/exchange/: compress each named part,
exchange payloads or summable phases, reduce, decode, divide; two levels and device chains
included). FSDP2's shards on a replicate group, DiLoCo's pseudo-gradients every H steps, or a
script's own tensors call it:

    exchange = bps_gc.torch.CompressedExchange({"compressor": "topk", "k": 0.01, "ef": "vanilla"})
    exchange({"fc.weight": g1, "fc.bias": g2}, group=replicate_group).wait()  # averaged in place

Each tensor is a part, its codec state kept under its name (its seed key comes from the name,
so a part's codec follows its name, not its place in the call). Every rank of ``group`` calls
with the same names in the same order, as every DDP rank reduces the same buckets. Its state is
part of ``bps_gc.torch.state_dict()``; loading it needs ``named_parameters`` (tensors of the
parts' sizes, on their devices), as the DDP hook's does.

On the parameter server, ``PushPullExchange`` (below) has the same call shape and pushes and
pulls each part under a declared name; ``named_exchange`` picks the one of the job's transport
(``Communicator.reduces_on_process_groups``).
"""
import itertools
import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist

import bps_gc.core as core

from . import ops
from ..comm import NodeFailure
from ..comm.exit_threads import join_at_exit
from .checkpoint import register
from .ddp.hook import CompressionHook, parts_batch


class CompressedExchange:
    """Named tensors averaged over a process group with one codec (``compression_params``, as
    ``comm_hook`` takes them); ``named_parameters``: [(name, tensor)] that the parts are the
    gradients of, where checkpoints are to be loaded; ``traffic``: the comm.metrics.Counters its
    bytes count in (default: the DDP hook's, metrics()' main fields); ``seed_rank``: the rank the
    codecs' draws are seeded by (default: this process's torch.distributed rank)."""

    def __init__(self, compression_params=None, reducer=None, named_parameters=None, traffic=None, seed_rank=None):
        named = None if named_parameters is None else list(named_parameters)
        self.hook = register(CompressionHook(compression_params, reducer, None, named, traffic, seed_rank), "exchange")
        # its parts' codecs share scratch buffers, freed after each call: between calls they
        # hold their state alone (FSDP2's many shards, docs/fsdp.md "Bytes and memory per codec")
        self.hook.pipeline.share_scratch()
        self.parameters = None if named is None else dict(named)
        self.batches = {}  # the names of a call -> its batch index (made in call order, alike on every rank)

    def dense_average(self, tensor, group):
        """Average ``tensor`` over ``group`` in place with torch's all_reduce, no codec (a dense
        step: register_fsdp_hooks' ``dense_steps``), its bytes counted as the exchange's."""
        dist.all_reduce(tensor, group=group)
        tensor.div_(dist.get_world_size(group))
        n = tensor.numel() * tensor.element_size()
        self.hook.traffic.add(pushed_raw=n, pulled_raw=n, pushed_wire=n, pulled_wire=n)

    def __call__(self, tensors, group=None, lr=0.0):
        """Average ``tensors`` ({name: tensor} or [(name, tensor)], one dtype and device) over
        ``group``'s ranks (default: every rank), in place; a torch Future of the same mapping.
        ``lr``: the learning rate error feedback rescales by."""
        named = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        names = tuple(name for name, _ in named)
        problem = check_parts(named)
        if problem:
            raise ValueError(f"CompressedExchange: {problem}")
        index = self.batches.setdefault(names, len(self.batches))
        buffer = torch.cat([t.detach().reshape(-1) for _, t in named])  # the pipeline writes the average here
        parameters = None if self.parameters is None else [self.parameters.get(name) for name in names]
        if parameters is not None and any(p is None for p in parameters):
            missing = [n for n, p in zip(names, parameters) if p is None]
            raise ValueError(f"CompressedExchange: {missing[:3]} are not among its named_parameters")
        # the call's named parts, each seeded by its name (codecs.name_key)
        batch = parts_batch(index, buffer, [tuple(t.shape) for _, t in named], parameters, names)
        future = self.hook.submit(group if group is not None else dist.group.WORLD, batch, float(lr))
        result = torch.futures.Future()

        def written_back(done):
            try:
                average, offset = done.value(), 0
                with torch.no_grad():
                    for _, tensor in named:
                        tensor.copy_(average[offset:offset + tensor.numel()].view_as(tensor))
                        offset += tensor.numel()
            except Exception as e:  # noqa: BLE001 (the result's waiter raises it)
                result.set_exception(unwrapped(e))
                return
            result.set_result(dict(named))
        future.add_done_callback(written_back)
        return result


class PushPullExchange:
    """CompressedExchange's counterpart on the parameter server, with its call shape: named
    float32 tensors averaged over every worker by push_pull (ops.push_pull_async), each under a
    name declared when this is made (``exchange.<i>.<name>``, the i-th made in this process,
    so every worker declares the same names in the same order, and a resumed job again), so
    each part's codec state (error feedback) carries across calls and is saved by
    ``bps_gc.torch.state_dict()`` with the communicator's, by tensor name. The pushes and pulls
    run on the worker's threads; a waiter thread completes the returned future.
    ``one_per_host``: each part is this local rank's own (its FSDP shard), pushed by the same
    local rank of every host and averaged over the hosts (``Communicator.declare``); ``dtype``:
    the parts' (float32, or float64; None: each named parameter's own, a one_per_host dense
    part's float16 or bfloat16 too: the servers sum and average it, wire/half.py)."""
    made = itertools.count()

    def __init__(self, compression_params=None, reducer=None, named_parameters=None, one_per_host=False,
                 dtype=torch.float32):
        named = list(named_parameters or ())
        if not named:
            raise ValueError("PushPullExchange: named_parameters are needed: the parameter server declares "
                             "every name, in order, before the first push")
        prefix = f"exchange.{next(PushPullExchange.made)}"
        extra = {} if reducer is None else {"reducer": reducer}
        self.keys = {}
        # the names sent uncompressed (below BYTEPS_MIN_COMPRESS_BYTES): the servers sum them
        # and no reducer runs, so their result is the plain average whatever ``reducer`` says
        self.averaged = set()
        for name, parameter in named:
            self.keys[name] = f"{prefix}.{name}"
            declaration = ops.declare(self.keys[name], shape=tuple(parameter.shape), dtype=dtype or parameter.dtype,
                                      **dict(compression_params or {}), **extra,
                                      **({"one_per_host": True} if one_per_host else {}))
            if not declaration.compressed:
                self.averaged.add(name)

    def __call__(self, tensors, group=None, lr=0.0, ctx=None):
        """Average ``tensors`` ({name: tensor} or [(name, tensor)]) over every worker, in place
        (with a reducer that does not sum, its result: ``outer_sgd``'s update); a torch Future
        of the same mapping. ``group`` must be None (the servers average over every worker);
        ``lr``: the learning rate error feedback rescales by; ``ctx``: more step context
        entries (the reducer's settings)."""
        named = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        problem = check_parts(named) or (None if group is None else NOT_A_GROUP)
        missing = [name for name, _ in named if name not in self.keys]
        if problem or missing:
            raise ValueError(f"PushPullExchange: {problem or f'{missing[:3]} are not among its named_parameters'}")
        handles = [ops.push_pull_async(tensor.detach(), average=True, name=self.keys[name], lr=float(lr),
                                       ctx=dict(ctx or {})) for name, tensor in named]
        if handles:  # BPS_GC_ELASTIC: one round group per call, ended here, not whenever the waiter
            ops.end_group(handles[-1])  # thread first waits (a later call could land in it)
        result = torch.futures.Future()

        def wait_all():
            try:
                for handle in handles:
                    ops.synchronize(handle)
            except Exception as e:  # noqa: BLE001 (the result's waiter raises it)
                result.set_exception(e)
                return
            result.set_result(dict(named))
        waiter = threading.Thread(target=wait_all, name="bps_gc-push-pull-exchange", daemon=True)
        waiter.start()
        join_at_exit(waiter)  # by then a failure has failed every handle: it ends at once
        return result

    def server_values(self, name, attr):
        """The array ``attr`` of the servers' reducer state of part ``name`` (``outer_sgd``'s
        ``global_copy``: DiLoCo's global copy), fetched from its servers, as a flat tensor."""
        return torch.from_numpy(core.communicator().server_values(self.keys[name], attr))

    def set_server_values(self, name, attr, tensor):
        """Seed ``attr`` of the servers' reducer state of part ``name``, before its first call."""
        core.communicator().set_server_values(self.keys[name], attr, tensor.detach().cpu().numpy())


NOT_A_GROUP = ("the parameter server averages over every worker; a process group (replicate=) is "
               "torch.distributed's (BPS_GC_TRANSPORT=collective)")


def named_exchange(compression_params=None, named_parameters=None, group=None, reducer=None, on_servers=False):
    """The exchange of the transport this job runs: ``CompressedExchange`` where reductions run
    on torch.distributed process groups (or bps_gc is not initialized: torch.distributed
    alone), else ``PushPullExchange``, which refuses a ``group`` (the one it would be called
    with). ``on_servers``: the caller needs the servers (a reducer that runs there, as
    ``outer_sgd``): refused on torch.distributed."""
    if not core.is_initialized() or core.communicator().reduces_on_process_groups:
        if on_servers:
            raise ValueError(f"reducer {reducer!r} runs on the parameter server's servers "
                             "(BPS_GC_TRANSPORT=ps, after bps_gc.torch.init()); this job runs torch.distributed")
        return CompressedExchange(compression_params, reducer, named_parameters=named_parameters)
    if group is not None:
        raise ValueError(NOT_A_GROUP)
    return PushPullExchange(compression_params, reducer, named_parameters=named_parameters)


WRAPPED = "Got the following error when running the callback: "


def interruptible_wait(future):
    """``future.wait()``, waited for in slices a signal can come between: torch's wait is one
    C++ call, in which a Ctrl-C stays pending until the exchange ends (and after a peer's
    Ctrl-C it may never end)."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    while not done.wait(0.05):
        pass
    try:
        return future.wait()
    except RuntimeError as e:
        # a Ctrl-C that came while a callback ran on this thread (``then`` on a future already
        # done runs it at once) is kept by torch as this error's text: a Ctrl-C again, so the
        # script ends on bps_gc's one line rather than a traceback
        if wrapped_text(e).startswith("KeyboardInterrupt"):
            raise KeyboardInterrupt from None
        raise


def wrapped_text(error):
    """``error``'s text without torch's prefixes for an error raised in a future's callback."""
    text = str(error)
    while text.startswith(WRAPPED):
        text = text[len(WRAPPED):]
    return text


def unwrapped(error):
    """``error`` as the exception it was: torch raises an error of a chained future's callback
    as a RuntimeError carrying its text (and the pipeline's futures are chained); a failed
    peer's NodeFailure becomes itself again, so the script ends on one line naming the rank
    (bps_gc's excepthook) rather than a traceback."""
    kind, _, message = wrapped_text(error).partition(": ")
    return NodeFailure(message.split("\n\nAt:\n")[0]) if kind == "NodeFailure" else error


def check_parts(named):
    """What is wrong with the named tensors of a call, or None."""
    if not named:
        return "no tensors to exchange"
    names = [name for name, _ in named]
    if not all(isinstance(name, str) and name for name in names):
        return f"every part needs a non-empty string name, got {[n for n in names if not isinstance(n, str) or not n][:3]}"
    if len(set(names)) != len(names):
        return f"names repeat: {sorted({n for n in names if names.count(n) > 1})[:3]}"
    tensors = [t for _, t in named]
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        return "every part must be a floating-point torch tensor"
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        return f"the parts mix dtypes or devices: {sorted(map(str, kinds))}"
    return None
