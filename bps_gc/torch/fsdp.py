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
``bps_gc.torch.metrics()`` counts its bytes as it counts the DDP hook's.
"""
import math

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from .exchange import CompressedExchange


def register_fsdp_hooks(model, replicate, compression_params=None, reducer=None):
    """Register on every FSDPModule of ``model`` a hook that averages its shards' gradients over
    ``replicate`` (a 1-D DeviceMesh, e.g. ``mesh["replicate"]``, or a process group) through
    ``compression_params``'s codec (dense without one). Returns the CompressedExchange, whose
    codec state ``bps_gc.torch.state_dict()`` saves."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("register_fsdp_hooks: the model has no FSDPModule; shard it first with "
                         "fully_shard(module, mesh=mesh['shard'])")
    group = replicate_group(replicate)
    exchange = CompressedExchange(compression_params, reducer)
    for module in modules:
        param_groups = module._get_fsdp_state()._fsdp_param_groups  # torch's: the shards' layout
        for param_group in param_groups:
            mesh = param_group.mesh_info.mesh
            if mesh.ndim != 1:
                raise ValueError(f"register_fsdp_hooks: {type(module).__name__} is sharded on a {mesh.ndim}-D mesh "
                                 f"{tuple(mesh.shape)}: native HSDP would all-reduce before the hook; shard it "
                                 "on mesh['shard'] instead and pass mesh['replicate'] here")
        if param_groups:
            module.set_all_reduce_hook(shard_hook(exchange, group, param_groups[0]))
    return exchange


def replicate_group(replicate):
    """The process group of ``replicate`` (a 1-D DeviceMesh or a process group)."""
    if isinstance(replicate, DeviceMesh):
        if replicate.ndim != 1:
            raise ValueError(f"register_fsdp_hooks: the replicate mesh must be 1-D (mesh['replicate']), "
                             f"got shape {tuple(replicate.shape)}")
        return replicate.get_group()
    return replicate


def shard_hook(exchange, group, param_group):
    """The all-reduce hook of one FSDP parameter group: its reduce-scatter output cut into the
    parameters' padded shards, named, averaged over ``group`` in place."""
    parts = []  # [(name, padded shard shape)], made at the first call: FSDP names its
    # parameters (their fully qualified names from the root) at its lazy init, on the first forward

    def average_over_replicas(reduce_output):
        if not parts:
            shard = param_group.mesh_info.shard_mesh_rank
            parts.extend((f"{p._param_fqn}#shard{shard}", tuple(p.padded_sharded_param_size))
                         for p in param_group.fsdp_params)
        sizes = [math.prod(shape) for _, shape in parts]
        if reduce_output.numel() != sum(sizes):
            raise RuntimeError(f"bps_gc register_fsdp_hooks: a reduce-scatter output of {reduce_output.numel()} "
                               f"elements, but its shards hold {sum(sizes)}")
        pieces = reduce_output.split(sizes)  # each shard in its shape: PowerSGD's matrix
        exchange([(name, piece.view(shape)) for (name, shape), piece in zip(parts, pieces)], group=group).wait()
    return average_over_replicas
