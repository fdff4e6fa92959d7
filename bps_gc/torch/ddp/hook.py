"""A DDP communication hook that sends any bps_gc codec's payloads instead of dense buckets.

    ddp_model.register_comm_hook(None, bps_gc.torch.comm_hook({"compressor": "onebit", "ef": "vanilla"}))

``hook(process_group, bucket) -> Future[Tensor]`` returning the bucket's average, as torch's own
hooks. The hook is an adapter: it names a DDP bucket's parts (codecs.Batch: each gradient a part,
its codec kept by parameter, seeded by the bucket index and position where it was first seen,
so seeds agree on every rank) and hands them to the compressed exchange's pipeline
(bps_gc/collective/exchange/, docs/runtime.md "One compressed exchange"), which returns a pending
future at once and reduces on its own threads as the parameter server would, so the result is
the server's (docs/ddp_hook.md). Without a compressor it is an all_reduce (float16 with
``fp16``). The learning rate error feedback rescales by is ``optimizer``'s when the hook is
called. An error on the pipeline's threads (a codec's, a failed peer's) is the future's: DDP
raises it from backward().
"""
import math

import torch.distributed as dist

import bps_gc.core as core

from ... import compress
from ...collective.exchange import Batch, Pipeline
from ...collective.exchange.tensors import value
from ...collective.security import refuse_security_settings
from ..checkpoint import register
from ..dtensors import refuse_dtensors


class CompressionHook:
    """The hook's state: its ``pipeline`` (collective.exchange.Pipeline, each gradient's codec in
    ``pipeline.codecs``), the ``optimizer`` whose learning rate a call reads, or ``lr``. A named
    exchange (torch/exchange.py) hands ``submit`` its named parts itself."""

    def __init__(self, compression_params=None, reducer=None, optimizer=None, named_parameters=None, traffic=None,
                 seed_rank=None):
        refuse_security_settings()  # DDP's links take no token: refused, never silently ignored
        self.params = compress.CompressionParams.from_dict(dict(compression_params or {}))
        self.optimizer = optimizer
        self.reducer = compress.choose_reducer(self.params, reducer)  # names both if they misfit
        self.lr = 0.0  # without an optimizer: the learning rate of the next call (current_lr)
        # what bps_gc.core.metrics() reports, with or without init() (``traffic``: counters of its own)
        self.traffic = traffic if traffic is not None else core.hook_traffic()
        named = None if named_parameters is None else list(named_parameters)
        self.pipeline = Pipeline(self.params, self.reducer, optimizer, named, self.traffic, seed_rank)
        # the gradients' numpy codecs share their in-call buffers (a server's sum, a decoded
        # payload), kept for the next step: one per use and thread, the largest gradient's size,
        # where each codec kept its own (onebit+EF held 6x the gradients, now 4.3x: docs/ddp_hook.md)
        self.pipeline.share_scratch(free_after_call=False)

    def __call__(self, process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        # DDP reads a failed Python future's exception as its value ("Unable to cast ... to
        # Tensor"); a callback that raises it marks the chained future failed, with the
        # exception's type and text in the error DDP raises
        return self.submit(group, batch_of(bucket), self.current_lr())

    def submit(self, group, batch, lr):
        """``batch`` (codecs.Batch: named parts) averaged over ``group`` by the pipeline: a future
        of its buffer (failed with the pipeline's error)."""
        comm = core.communicator() if core.is_initialized() else None  # its waits watch the heartbeat
        return self.pipeline.submit(group, batch, lr, comm).then(value)

    def current_lr(self):
        """The learning rate error feedback rescales by: the optimizer's now, else ``lr``."""
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else float(self.lr)

    def codec_state(self):
        """A Stateful of every gradient's codec, by parameter name (bps_gc/torch/checkpoint.py),
        once no call is in flight."""
        self.pipeline.idle()
        return self.pipeline.codecs.codec_state()

    def codec_state_to_load(self, sd):
        """(the fresh codecs ``sd`` loads into, a function installing them once loaded)."""
        return self.pipeline.codecs.codec_state_to_load(sd, core.device_codecs())


def batch_of(bucket):
    """DDP's bucket (or the tests' stand-in of one) as named parts (``parts_batch``)."""
    grads = bucket.gradients()
    return parts_batch(bucket.index(), bucket.buffer(), [tuple(g.shape) for g in grads],
                       bucket.parameters() if hasattr(bucket, "parameters") else None,
                       bucket.names() if hasattr(bucket, "names") else None)


def parts_batch(index, buffer, shapes, parameters=None, names=None):
    """Batch ``index``: the flat ``buffer`` cut into parts of ``shapes``, each part's codec kept
    under its parameter (``parameters``: DDP's buckets), its name (``names``: a named exchange,
    torch/exchange.py), or the batch index and its position (neither); keyed by name where the
    parts are named, else by index and position."""
    if parameters is not None:
        ids = [id(p) for p in parameters]
    else:
        ids = list(names) if names is not None else [(index, position) for position in range(len(shapes))]
    return Batch(index, buffer, [math.prod(shape) for shape in shapes], ids,
                 None if names is None else list(names), list(shapes), core.device_codecs())


def comm_hook(compression_params=None, reducer=None, optimizer=None, named_parameters=None):
    """A hook for ``DistributedDataParallel.register_comm_hook(process_group_or_None, hook)``;
    a plain function (DDP logs and checks hooks by their function name), its per-gradient codec
    state in ``hook.compression``, saved by bps_gc.torch.state_dict() under the names of
    ``named_parameters`` (model.named_parameters(); else ``optimizer``'s parameter order). A
    sharded model's DTensor parameters (in either) are refused, naming register_fsdp_hooks."""
    named_parameters = None if named_parameters is None else list(named_parameters)
    optimized = [] if optimizer is None else [p for group in optimizer.param_groups for p in group["params"]]
    refuse_dtensors("comm_hook", (named_parameters or []) + [(f"param.{i}", p) for i, p in enumerate(optimized)],
                    "instead of DDP")
    compression = register(CompressionHook(compression_params, reducer, optimizer, named_parameters), "comm_hook")

    def bps_gc_comm_hook(process_group, bucket):
        return compression(process_group, bucket)
    bps_gc_comm_hook.compression = compression
    return bps_gc_comm_hook
