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
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

import bps_gc.core as core

from ..compress.stateful import StateError
from .checkpoint import Fields, register
from .exchange import CompressedExchange, interruptible_wait


def register_fsdp_hooks(model, replicate, compression_params=None, reducer=None):
    """Register on every FSDPModule of ``model`` (the root module FSDP runs: its parameter
    names are the shards' names) a hook that averages its shards' gradients over ``replicate``
    (a 1-D DeviceMesh, e.g. ``mesh["replicate"]``, or a process group) through
    ``compression_params``'s codec (dense without one). Returns the CompressedExchange, whose
    codec state ``bps_gc.torch.state_dict()`` saves and ``load_state_dict()`` restores."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("register_fsdp_hooks: the model has no FSDPModule; shard it first with "
                         "fully_shard(module, mesh=mesh['shard'])")
    group = replicate_group(replicate)
    groups = [(module, param_group) for module in modules
              for param_group in module._get_fsdp_state()._fsdp_param_groups]  # torch's: the shards' layout
    for module in modules:
        count = len(module._get_fsdp_state()._fsdp_param_groups)
        if count > 1:
            raise ValueError(f"register_fsdp_hooks: {type(module).__name__} has {count} parameter groups "
                             "(shard_placement_fn's per-parameter meshes); FSDP2 takes one all-reduce hook per "
                             "module: shard every parameter of a module alike")
    for module, param_group in groups:
        mesh = param_group.mesh_info.mesh
        if mesh.ndim != 1:
            raise ValueError(f"register_fsdp_hooks: {type(module).__name__} is sharded on a {mesh.ndim}-D mesh "
                             f"{tuple(mesh.shape)}: native HSDP would all-reduce before the hook; shard it "
                             "on mesh['shard'] instead and pass mesh['replicate'] here")
    if not groups:
        raise ValueError("register_fsdp_hooks: the model's FSDPModules hold no parameters")
    check_replicate_group(group, groups[0][1].mesh_info.mesh)
    mesh_info = groups[0][1].mesh_info
    # before the exchange: a checkpoint of another mesh is refused first, naming both shapes
    layout = register(ShardLayout(dist.get_world_size(group), mesh_info.shard_mesh_size,
                                  mesh_info.shard_mesh_rank), "fsdp_hooks")
    names = {id(p): name for name, p in model.named_parameters()}
    # each shard a named part whose stand-in tensor (its padded shape, reduce dtype and device)
    # the codec is kept under, so a checkpoint's codecs load before the first step
    # (FSDP2 reduces the parameters that have gradients: the trainable ones)
    shards = {id(param_group): [shard_part(param_group, p, names) for p in param_group.fsdp_params
                                if p.sharded_param.requires_grad] for _, param_group in groups}
    exchange = CompressedExchange(compression_params, reducer,
                                  named_parameters=[part for parts in shards.values() for part in parts])
    exchange.layout = layout  # kept alive with the exchange (checkpoints hold weak references)
    refuse_unfit_codec(exchange, [part for parts in shards.values() for part in parts])
    for module, param_group in groups:
        if shards[id(param_group)]:
            module.set_all_reduce_hook(shard_hook(exchange, group, shards[id(param_group)]))
    return exchange


def shard_part(param_group, fsdp_param, names):
    """(``<fqn>#shard<i>``, a tensor standing for the reduce-scatter's piece of ``fsdp_param``)."""
    name = names.get(id(fsdp_param.sharded_param))
    if name is None:
        raise ValueError("register_fsdp_hooks: a sharded parameter is not among the model's parameters; "
                         "pass the root module (the one fully_shard was called on last)")
    policy, dtype = param_group.mp_policy, fsdp_param.sharded_param.dtype
    reduce_dtype = policy.reduce_dtype or policy.param_dtype or dtype  # FSDP2's rule
    stand_in = torch.empty(tuple(fsdp_param.padded_sharded_param_size), dtype=reduce_dtype,
                           device=param_group.device)
    return f"{name}#shard{param_group.mesh_info.shard_mesh_rank}", stand_in


def refuse_unfit_codec(exchange, parts):
    """Refuse, before any step, a codec that cannot take the reduce dtype of some shard (float64,
    for TernGrad, QSGD, sign...: docs/ddp_hook.md "Dtypes"; bfloat16 and float16 are widened to
    float32 for every codec), one line naming the codec, the dtype and a shard of it."""
    params, checked = exchange.hook.params, set()
    if not params.compressor:
        return
    for name, stand_in in parts:
        if stand_in.dtype in checked:
            continue
        checked.add(stand_in.dtype)
        problem = exchange.hook.pipeline.codecs.refusal(name, stand_in, core.device_codecs())
        if problem:
            raise TypeError(f"register_fsdp_hooks: compressor {params.compressor!r} cannot take the reduce dtype "
                            f"{stand_in.dtype} of {name!r} ({problem}); set fully_shard's "
                            "mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32) or choose a codec that "
                            "carries it")


class ShardLayout:
    """The mesh a checkpoint of the hooks' codecs was saved on, (replicas, shards), and this
    rank's shard index: the codec state is per shard, so loading it on another mesh is refused,
    naming both (start the codecs afresh by not loading bps_gc's state: docs/fsdp.md)."""

    def __init__(self, replicas, shards, shard):
        self.identity = {"mesh": f"({replicas}, {shards})", "shard": shard}

    def codec_state(self):
        return Fields(self, (), self.identity)

    def codec_state_to_load(self, sd):
        saved = (sd.get("identity.mesh"), sd.get("identity.shard"))
        if saved != (self.identity["mesh"], self.identity["shard"]):
            raise StateError(f"register_fsdp_hooks: the codec state was saved on the mesh (replicas, shards) "
                             f"{saved[0]} as shard {saved[1]}, and this rank is shard {self.identity['shard']} of "
                             f"{self.identity['mesh']}; the codecs are per shard: load the model and optimizer "
                             "alone to start them afresh")
        return self.codec_state(), lambda: None


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


def shard_hook(exchange, group, parts):
    """The all-reduce hook of one FSDP parameter group: its reduce-scatter output cut into the
    parameters' padded shards (``parts``: [(name, stand-in tensor)], in the group's order),
    named, averaged over ``group`` in place."""
    sizes = [stand_in.numel() for _, stand_in in parts]

    def average_over_replicas(reduce_output):
        if reduce_output.numel() != sum(sizes):
            raise RuntimeError(f"bps_gc register_fsdp_hooks: a reduce-scatter output of {reduce_output.numel()} "
                               f"elements, but its shards hold {sum(sizes)} (a parameter without a gradient "
                               "this step?)")
        if (reduce_output.dtype, reduce_output.device) != (parts[0][1].dtype, parts[0][1].device):
            raise RuntimeError(f"bps_gc register_fsdp_hooks: a reduce-scatter output of {reduce_output.dtype} on "
                               f"{reduce_output.device}, where the MixedPrecisionPolicy gives "
                               f"{parts[0][1].dtype} on {parts[0][1].device}")
        pieces = reduce_output.split(sizes)  # each shard in its shape: PowerSGD's matrix
        interruptible_wait(exchange([(name, piece.view(stand_in.shape))
                                     for (name, stand_in), piece in zip(parts, pieces)], group=group))
    return average_over_replicas
