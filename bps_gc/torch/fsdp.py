"""FSDP2 and HSDP with a bps_gc codec on the replicate dimension: the model is sharded inside a
host (fast links) with ``fully_shard`` on the shard sub-mesh, and each parameter group's
reduce-scatter output is averaged across the replicas (slow links) by bps_gc's compressed
exchange (torch/exchange.py) instead of a dense all_reduce:

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    bps_gc.torch.register_fsdp_hooks(model, mesh["replicate"], {"compressor": "topk", "k": 0.01, "ef": "vanilla"})

FSDP2 calls the hook (``FSDPModule.set_all_reduce_hook``) with each group's flat reduce-scatter
output, the parameters' padded shards back to back, after the in-host reduce-scatter and
before its post-divide; the hook averages it across the replicate group in place. Each
parameter's shard is one named part, ``<fqn>#shard<i>`` (i: the shard's index in the shard
sub-mesh), so its codec state is the shard's own and follows its name; replicas that hold the
same shard share the name. On torch.distributed it needs no ``bps_gc.torch.init()``;
``bps_gc.torch.metrics()`` counts its bytes as it counts the DDP hook's. With
``replicate=None`` the parameter server is the replicate reducer instead (fsdp_ps.py); what
both take from the model is fsdp_shards.py's.
"""
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .checkpoint import register
from .exchange import CompressedExchange, interruptible_wait
from .fsdp_inhost import compress_in_host
from .fsdp_ps import register_on_servers
from .fsdp_shards import ShardLayout, refuse_unfit_codec, shard_parts, shard_pieces, sharded_groups  # noqa: F401 (tests)


def register_fsdp_hooks(model, replicate=None, compression_params=None, reducer=None, shard_compression_params=None,
                        dense_steps=0):
    """Register on every FSDPModule of ``model`` (the root module FSDP runs: its parameter
    names are the shards' names) a hook that averages its shards' gradients over ``replicate``
    (a 1-D DeviceMesh, e.g. ``mesh["replicate"]``, or a process group) through
    ``compression_params``'s codec (dense without one). Returns the CompressedExchange, whose
    codec state ``bps_gc.torch.state_dict()`` saves and ``load_state_dict()`` restores.
    ``replicate=None``: the parameter server is the replicate reducer (after
    ``bps_gc.torch.init()`` under bpslaunch, the model sharded over the host's local ranks:
    fsdp_ps.py); returns its PushPullExchange. ``shard_compression_params`` (off: None; ``{}``:
    the same path without a codec): FSDP2's in-host reduce-scatter compressed too, through a
    second exchange (fsdp_inhost.py, docs/fsdp_inhost.md), its bytes metrics()' ``in_host_*``.
    ``dense_steps``: the first that many steps average dense (gloo/NCCL all_reduce on ``replicate``,
    as native HSDP), the codec from then on (PowerSGD's ``start_powerSGD_iter``)."""
    if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 0:
        raise ValueError(f"register_fsdp_hooks: dense_steps must be a whole number >= 0, got {dense_steps!r}")
    if replicate is None and dense_steps:
        raise ValueError("register_fsdp_hooks: dense_steps needs a replicate group (torch.distributed's "
                         "all_reduce); the parameter server path has none")
    groups = sharded_groups(model)
    if replicate is None:
        return register_on_servers(model, groups, compression_params, reducer, shard_compression_params)
    group = replicate_group(replicate)
    check_replicate_group(group, groups[0][1].mesh_info.mesh)
    mesh_info = groups[0][1].mesh_info
    # before the exchange: a checkpoint of another mesh is refused first, naming both shapes
    layout = register(ShardLayout(dist.get_world_size(group), mesh_info.shard_mesh_size,
                                  mesh_info.shard_mesh_rank, dense_steps, len(groups)), "fsdp_hooks")
    shards = shard_parts(model, groups)
    exchange = CompressedExchange(compression_params, reducer,
                                  named_parameters=[part for parts in shards.values() for part in parts])
    exchange.layout = layout  # kept alive with the exchange (checkpoints hold weak references)
    refuse_unfit_codec(exchange, [part for parts in shards.values() for part in parts])
    if shard_compression_params is not None:  # kept alive with the exchange, as the layout
        exchange.in_host = compress_in_host(shard_compression_params, groups, shards, mesh_info.shard_mesh_size)
    for index, (module, param_group) in enumerate(groups):
        if shards[id(param_group)]:
            module.set_all_reduce_hook(shard_hook(exchange, group, shards[id(param_group)],
                                                  layout if dense_steps else None, index))
    return exchange


def replicate_group(replicate):
    """The process group of ``replicate`` (a 1-D DeviceMesh or a process group)."""
    if isinstance(replicate, DeviceMesh):
        if replicate.ndim != 1:
            raise ValueError(f"register_fsdp_hooks: the replicate mesh must be 1-D (mesh['replicate']), "
                             f"got shape {tuple(replicate.shape)}")
        return replicate.get_group()
    return replicate


def check_replicate_group(group, shard_mesh):
    """Refuse a replicate group that is not this rank's replicas of its shard: HSDP's replicate
    groups hold one rank of each shard group, and the two tile the job."""
    replicas = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    shards, rank = shard_mesh.mesh.flatten().tolist(), dist.get_rank()
    if rank not in replicas or set(replicas) & set(shards) != {rank} or \
            len(replicas) * len(shards) != dist.get_world_size():
        raise ValueError(f"register_fsdp_hooks: the replicate group (ranks {replicas}) does not match the mesh: "
                         f"rank {rank} shards with ranks {shards}; pass mesh['replicate'] of the mesh whose "
                         "mesh['shard'] the model is sharded on")


def shard_hook(exchange, group, parts, layout=None, index=0):
    """The all-reduce hook of one FSDP parameter group: its reduce-scatter output cut into the
    parameters' padded shards (``parts``: [(name, stand-in tensor)], in the group's order),
    named, averaged over ``group`` in place; a dense average while the group (``index``) has
    done fewer than ``layout.dense_steps``."""
    def average_over_replicas(reduce_output):
        if layout is not None and layout.dense_done[index] < layout.dense_steps:
            layout.dense_done[index] += 1
            exchange.dense_average(reduce_output, group)  # counted in metrics() as the codec's bytes
            return
        interruptible_wait(exchange(shard_pieces(reduce_output, parts), group=group))
    return average_over_replicas
