"""``register_fsdp_hooks(..., shard_compression_params=...)``: FSDP2's in-host reduce-scatter
compressed too, for hosts whose ranks talk over slow links (no NVLink). Off by default.

FSDP2 hands a ReduceScatter (``FSDPModule.set_custom_reduce_scatter``) each parameter group's
flat input, one chunk per rank of the shard group back to back (chunk d: the padded shards of
the group's parameters that shard d keeps, in the group's order), and an output of one chunk.
``CompressedReduceScatter`` names each parameter's piece of each chunk
``<fqn>#to_shard<d>``, so every piece has its own codec state (error feedback...) kept and
checkpointed by its parameter and destination, averages the input over the shard group
through a ``CompressedExchange`` of its own (the one pipeline: docs/runtime.md "One compressed
exchange"), and copies its own chunk out (times the group's size where FSDP2 asks for a sum).
Each chunk's payloads go to their own rank alone, in one all_to_all (``Pipeline.reduce_at``),
which reduces its own chunk alone: a rank sends each peer only that peer's chunk, as a
reduce-scatter does, and sums its own chunk's values as they are with the peers' decoded
payloads, since they never leave it (thc and PowerSGD still all-reduce their phases over the
whole input and decode every chunk; sign's majority vote takes every rank's signs:
docs/fsdp_inhost.md).
Its bytes count in ``bps_gc.torch.metrics()``'s ``in_host_*`` fields. Either replicate reducer
takes it (``compress_in_host``): torch.distributed's replicate group (fsdp.py) or the parameter
server (fsdp_ps.py, where the shard group is the host's local ranks, a torch.distributed group
of their own).
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # torch's interface (not exported)

import bps_gc.core as core

from .. import compress
from .exchange import CompressedExchange, interruptible_wait
from .fsdp_shards import refuse_unfit_codec, shard_pieces


def destination_parts(parts, shards):
    """[[(``<fqn>#to_shard<d>``, stand-in)] for each destination shard d]: ``parts`` (a parameter
    group's [(``<fqn>#shard<i>``, stand-in)]) as the pieces of each chunk of its reduce-scatter
    input, which have the shards' padded shapes. Each piece a stand-in of its own: the exchange
    keeps a part's codec under its tensor's id."""
    return [[(f"{name.rsplit('#shard', 1)[0]}#to_shard{d}", stand_in.expand(stand_in.shape))
             for name, stand_in in parts] for d in range(shards)]


def in_host_reducer(compression_params):
    """The in-host step's reducer: the codec's own, except that one that re-compresses the sum
    (as a server does before its reply) sums exactly instead: a rank's reduced chunk is its own
    and is sent nowhere after, so re-compressing it would only add error, a second residual
    (the EF codecs' state then S + 1 times the shard, not S) and CPU."""
    reducer = compress.choose_reducer(compress.CompressionParams.from_dict(dict(compression_params or {})))
    return "lossless" if reducer == "recompress" else None


def in_host_exchange(compression_params, shards_of_groups, shards, seed_rank=None):
    """The in-host step's CompressedExchange over every group's pieces (its state saved by
    ``bps_gc.torch.state_dict()``), its bytes counted apart (metrics()' ``in_host_*``)."""
    named = [piece for parts in shards_of_groups for chunk in destination_parts(parts, shards) for piece in chunk]
    exchange = CompressedExchange(compression_params, in_host_reducer(compression_params), named_parameters=named,
                                  traffic=core.in_host_traffic(), seed_rank=seed_rank)
    exchange.hook.pipeline.keep_saved_reducers(["recompress"])  # checkpoints from before: they resume as they ran
    return exchange


def compress_in_host(compression_params, groups, shards, size, seed_rank=None):
    """FSDP2's reduce-scatter of every parameter group of ``groups`` [(FSDPModule, parameter
    group)] compressed with ``compression_params`` (``shards``: shard_parts' {id(parameter
    group): [(``<fqn>#shard<i>``, stand-in)]}; ``size``: the shard group's), through one
    in_host_exchange, whose codec is refused first, in one line, if it cannot take a shard's
    reduce dtype. Returns that exchange: the caller keeps it alive (checkpoints hold weak
    references)."""
    in_host = in_host_exchange(compression_params, list(shards.values()), size, seed_rank)
    refuse_unfit_codec(in_host, [part for parts in shards.values() for part in parts], "shard_compression_params")
    # this rank reads its own chunk alone: each chunk's pieces go to their own rank alone (an
    # all_to_all), which reduces them (no server chain here of the others, none of their state)
    own = groups[0][1].mesh_info.shard_mesh_rank
    in_host.hook.pipeline.reduce_at(lambda name: int(name.rsplit("#to_shard", 1)[1]), own)
    for module, param_group in groups:
        if shards[id(param_group)]:
            module.set_custom_reduce_scatter(CompressedReduceScatter(in_host, shards[id(param_group)], size, own))
    return in_host


class CompressedReduceScatter(ReduceScatter):
    """One parameter group's reduce-scatter through ``exchange`` (``parts``: the group's
    [(``<fqn>#shard<i>``, stand-in)], in its order; ``shards``: the shard group's size; ``own``:
    this rank's index in it, the one chunk the exchange reduces here)."""

    def __init__(self, exchange, parts, shards, own):
        self.exchange, self.shards, self.own = exchange, shards, own
        self.destinations = destination_parts(parts, shards)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        # FSDP2 asks for AVG (float32, bfloat16) or SUM after its own pre-divide (other dtypes);
        # PREMUL_SUM comes with set_gradient_divide_factor
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"register_fsdp_hooks: the compressed reduce-scatter (shard_compression_params) "
                             f"averages or sums, and FSDP2 asked for {op}: drop set_gradient_divide_factor")
        chunks = input_tensor.view(self.shards, -1)
        if (dist.get_world_size(group), dist.get_rank(group)) != (self.shards, self.own) or \
                output_tensor.numel() != chunks.shape[1]:
            raise RuntimeError(f"bps_gc register_fsdp_hooks: a reduce-scatter of {input_tensor.numel()} elements "
                               f"over {dist.get_world_size(group)} ranks into {output_tensor.numel()} as rank "
                               f"{dist.get_rank(group)}, where the shard group has {self.shards} ranks and this "
                               f"is shard {self.own}")
        named = [piece for d, chunk in enumerate(chunks) for piece in shard_pieces(chunk, self.destinations[d])]
        interruptible_wait(self.exchange(named, group=group))  # the average of its own chunk, in place
        own = chunks[self.own]
        with torch.no_grad():
            output_tensor.copy_(own if op == dist.ReduceOp.AVG else own * self.shards)
        return None  # done: FSDP2 calls it synchronously (async_op=False) and reads no Work
