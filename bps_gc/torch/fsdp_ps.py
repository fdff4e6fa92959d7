"""HSDP whose cross-host step is the parameter server's push and pull: under ``bpslaunch``
(DMLC_NUM_WORKER hosts, one worker process per local rank), the model is sharded inside each
host over its local ranks, and each local rank pushes its own shard to the servers:

    bps.init()                                  # the parameter-server transport
    mesh = bps.host_mesh()                      # the host's local ranks, a 1-D DeviceMesh
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    bps.register_fsdp_hooks(model, None, {"compressor": "onebit", "ef": "vanilla"})

``replicate=None`` says the parameter server is the replicate reducer. Each parameter's shard
is a tensor of its own, ``<fqn>#shard<i>`` (i: the local rank), declared ``one_per_host``: the
same local rank of every host pushes it, so the servers sum one push per host for each shard
(and run their reducers on it: recompress, thc's summed lanes) and the hook divides by the
number of hosts. Local rank i's tensors are its alone: the host's other ranks never build
their codecs, so each rank's codec state is its shard's. ``shard_compression_params``
compresses the in-host reduce-scatter too (fsdp_inhost.py, over the host's torch.distributed
group), whose output is what each rank pushes.
"""
import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh

import bps_gc.core as core
from bps_gc.compress import CompressionParams, build_chain

from .checkpoint import Fields, register
from .exchange import PushPullExchange, interruptible_wait
from .fsdp_inhost import compress_in_host
from .host_group import host_group
from .ops import SUPPORTED
from .fsdp_shards import ShardLayout, shard_parts, shard_pieces, unfit_codec

NOT_ON_SERVERS = ("register_fsdp_hooks: replicate=None makes the parameter server the replicate reducer, which "
                  "needs bps_gc.torch.init() on the parameter-server transport first (bpslaunch with servers); "
                  "on torch.distributed pass the replicate group, e.g. mesh['replicate']")


def register_on_servers(model, groups, compression_params, reducer, shard_compression_params=None):
    """register_fsdp_hooks(model, None, ...): ``groups`` [(FSDPModule, parameter group)];
    ``shard_compression_params``: the in-host reduce-scatter compressed too, over the host's
    group (fsdp_inhost.py), before each shard is pushed."""
    if not core.is_initialized() or core.communicator().reduces_on_process_groups:
        raise ValueError(NOT_ON_SERVERS)
    comm = core.communicator()
    for _, param_group in groups:
        info = param_group.mesh_info
        if (info.shard_mesh_size, info.shard_mesh_rank) != (comm.local_size, comm.local_rank):
            raise ValueError(f"register_fsdp_hooks: on the parameter server the model is sharded over the host's "
                             f"local ranks (a mesh of {comm.local_size}, BYTEPS_LOCAL_SIZE, this rank shard "
                             f"{comm.local_rank}), but it is sharded on a mesh of {info.shard_mesh_size} as shard "
                             f"{info.shard_mesh_rank}; shard it on bps_gc.torch.host_mesh()")
    shards = shard_parts(model, groups)
    # each shard pushed in its wire dtype (float32; float64 and a dense float16 or bfloat16 kept;
    # with fp16 the float32 stand-in travels as float16: a bfloat16 tensor takes no fp16 wire)
    params = CompressionParams.from_dict(dict(compression_params or {}))
    dense = not params.compressed and not params.fp16 and comm.sums_half
    pushed = [(name, torch.empty((), dtype=wire_dtype(stand_in.dtype, dense)).expand(stand_in.shape))
              for parts in shards.values() for name, stand_in in parts]
    refuse_unfit_push_codec(compression_params, shards, pushed)  # before anything is registered or declared
    layout = register(HookLayout(comm.size // comm.local_size, comm.local_size, comm.local_rank, len(groups)),
                      "fsdp_hooks")
    in_host = None if shard_compression_params is None else \
        compress_in_host(shard_compression_params, groups, shards, comm.local_size,  # its refusal: before declaring
                         seed_rank=comm.rank)  # the host's group repeats local ranks: draws by the job's rank
    exchange = PushPullExchange(compression_params, reducer, named_parameters=pushed, one_per_host=True, dtype=None)
    # kept alive with the exchange (checkpoints hold weak references)
    exchange.layout, exchange.in_host = layout, in_host
    for index, (module, param_group) in enumerate(groups):
        if shards[id(param_group)]:
            module.set_all_reduce_hook(push_pull_hook(exchange, shards[id(param_group)], layout, index,
                                                      dict(pushed)))
    return exchange


def wire_dtype(reduce_dtype, dense=False):
    """What a shard of ``reduce_dtype`` is pushed as: float64 as is; float16 and bfloat16 as
    they are when ``dense`` (no codec, and the servers sum them in float32 and divide by the
    hosts before rounding once, wire/half.py); else float32 (the codecs take float32: a bfloat16
    or float16 reduce-scatter output is widened for the push, and the average rounded back into
    it, alike on every replica)."""
    if reduce_dtype == torch.float64 or (dense and reduce_dtype in (torch.bfloat16, torch.float16)):
        return reduce_dtype
    return torch.float32


def refuse_unfit_push_codec(compression_params, shards, pushed):
    """Refuse, before anything is declared, a codec that cannot take a shard's wire dtype
    (float64: TernGrad, QSGD, sign...), in torch.distributed's one line naming the reduce dtype."""
    params = CompressionParams.from_dict(dict(compression_params or {}))
    if not params.compressed:
        return
    reduce_dtypes = {name: stand_in.dtype for parts in shards.values() for name, stand_in in parts}
    checked = set()
    for name, wire in pushed:
        if wire.dtype in checked:
            continue
        checked.add(wire.dtype)
        try:  # a throwaway worker chain, as the declaration would build it
            build_chain(params, wire.numel(), SUPPORTED[wire.dtype], shape=tuple(wire.shape))
        except TypeError as e:
            raise TypeError(unfit_codec(params.compressor, reduce_dtypes[name], name, e)) from None


class HookLayout(ShardLayout):
    """ShardLayout, and the hooks' step counts (``steps[i]``: the calls of the i-th parameter
    group's hook so far), saved with it: a resumed job's per-step codec draws (thc's rounding,
    randomk's choice) go on from where they were."""

    def __init__(self, replicas, shards, shard, hooks):
        super().__init__(replicas, shards, shard)
        self.steps = np.zeros(hooks, np.int64)

    def codec_state(self):
        return Fields(self, ("steps",), self.identity)


def push_pull_hook(exchange, parts, layout, index, wire):
    """The all-reduce hook of one FSDP parameter group: each of its shards pushed by this rank
    (in its ``wire`` stand-in's dtype) and pulled as the average over the hosts, in place. Its
    n-th call (``layout.steps[index]``, which a checkpoint restores) is step n of the codecs'
    step context (their random draws, seeded by key and step, change every step)."""
    def average_over_hosts(reduce_output):
        pieces = shard_pieces(reduce_output, parts)
        carried = [(name, piece.to(wire[name].dtype)) for name, piece in pieces]  # no copy if the same
        step = int(layout.steps[index])
        layout.steps[index] += 1
        interruptible_wait(exchange(carried, ctx={"step": step}))
        with torch.no_grad():
            for (_, piece), (_, sent) in zip(pieces, carried):
                if sent is not piece:
                    piece.copy_(sent)
    return average_over_hosts


def host_mesh(device_type="cpu", backend=None):
    """After ``bps_gc.torch.init()`` on the parameter server: torch.distributed's default
    process group made of this host's local ranks (host_group.py), and its 1-D DeviceMesh,
    named "shard", to shard the model on."""
    host_group(backend, caller="host_mesh")
    return init_device_mesh(device_type, (core.local_size(),), mesh_dim_names=("shard",))
