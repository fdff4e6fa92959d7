"""DiLoCo over a model sharded with FSDP2 inside each replica: ``fully_shard(..., mesh=mesh["shard"])``
(no register_fsdp_hooks: FSDP2's reduce-scatter averages the inner gradients over the host's
ranks, and nothing crosses hosts between syncs), ``replicate=mesh["replicate"]``'s group:

    opt = bps_gc.torch.DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=50,
                              replicate=mesh["replicate"].get_group(), compression_params=...)

The parameters are DTensors; DiLoCo keeps a global copy of each rank's local shard alone and
averages its pseudo-gradient over ``replicate``, whose ranks hold the same shard on every
host, under the name ``<fqn>#shard<i>`` (i: the shard's index on its 1-D mesh), as
register_fsdp_hooks names its parts: its codec state follows the shard. On the parameter
server, ``replicate="hosts"`` with the model sharded on ``bps_gc.torch.host_mesh()``: each
host is one replica, and each local rank pushes its own shards (``HostShardsExchange``).
"""
import torch.distributed as dist

import bps_gc.core as core

from .dtensors import is_dtensor
from .exchange import PushPullExchange


def local(parameter):
    """The tensor DiLoCo reads and writes for ``parameter``: a DTensor's local shard (a view of
    its storage), else the parameter itself."""
    return parameter.to_local() if is_dtensor(parameter) else parameter


def pseudo_gradients(named, copies):
    """[(name, global copy - the rank's own tensor of the parameter, in float32)] of [(name,
    parameter)] and their global copies: what DiLoCo averages at a sync."""
    return [(name, copy - local(p).detach().float()) for (name, p), copy in zip(named, copies)]


def shard_names(named, replicate):
    """``named`` [(name, parameter)] with each DTensor renamed ``<name>#shard<i>``; a ValueError,
    in one line, where DiLoCo cannot average its shards: no process group to average over, a
    mesh of more than one dimension, or ranks of ``replicate`` that hold different shards."""
    sharded = [(name, p) for name, p in named if is_dtensor(p)]
    if not sharded:
        return named
    if replicate == "hosts":
        return on_hosts(named, sharded)
    if replicate is None or isinstance(replicate, str):
        raise ValueError(f"DiLoCo: {sharded[0][0]!r} is a DTensor (a model sharded with fully_shard): pass the "
                         "process group of the ranks that hold the same shard on every replica, "
                         "replicate=mesh['replicate'].get_group(), on torch.distributed (on the parameter "
                         "server: replicate='hosts', the model sharded on bps_gc.torch.host_mesh())")
    meshes = {p.device_mesh.ndim for _, p in sharded}
    if meshes != {1}:
        raise ValueError(f"DiLoCo: {sharded[0][0]!r} is sharded on a {max(meshes)}-D mesh: shard the model on "
                         "mesh['shard'] alone (fully_shard(..., mesh=mesh['shard'])) and pass "
                         "replicate=mesh['replicate'].get_group()")
    shards = {name: p.device_mesh.get_local_rank() for name, p in sharded}
    everyone = [None] * dist.get_world_size(replicate)
    dist.all_gather_object(everyone, shards, group=replicate)  # once, where the DiLoCo is made
    if any(other != shards for other in everyone):
        raise ValueError(f"DiLoCo: the ranks of replicate (ranks {dist.get_process_group_ranks(replicate)}) hold "
                         "different shards of the model: pass the group of the ranks with the same place on the "
                         "shard mesh, mesh['replicate'].get_group()")
    return [(f"{name}#shard{shards[name]}" if name in shards else name, p) for name, p in named]


def on_hosts(named, sharded):
    """The parameter server's replicate="hosts" over shards: each host one replica, sharded over
    its local ranks (bps_gc.torch.host_mesh()), so local rank i of every host holds shard i; a
    ValueError, in one line, for a model sharded on another mesh."""
    size, rank = core.local_size(), core.local_rank()
    whole = [name for name, p in named if not is_dtensor(p)]
    if whole:  # every local rank would push it, under one name declared one per host
        raise ValueError(f"DiLoCo: replicate='hosts' over a sharded model: {whole[0]!r} is not sharded: shard "
                         "every parameter on bps_gc.torch.host_mesh() (fully_shard the root module too)")
    for name, p in sharded:
        mesh = p.device_mesh
        place = (mesh.size(), mesh.get_local_rank()) if mesh.ndim == 1 else None
        if place != (size, rank):
            where = f"a 1-D mesh of {place[0]} ranks as shard {place[1]}" if place else f"a {mesh.ndim}-D mesh"
            raise ValueError(f"DiLoCo: replicate='hosts' over a sharded model: {name!r} is sharded on {where}, "
                             f"but this rank is local rank {rank} of {size} (BYTEPS_LOCAL_SIZE): shard the model "
                             "on bps_gc.torch.host_mesh()")
    return [(f"{name}#shard{rank}", p) for name, p in named]


class HostShardsExchange:
    """The exchange of replicate="hosts" over shards, with HostPartsExchange's calls (diloco_hosts.py):
    each local rank pushes the pseudo-gradients of its own shards (``<fqn>#shard<i>``), declared
    ``one_per_host``, so the servers sum one push per host and the replies are averaged over the
    hosts (or are ``outer_sgd``'s update), as register_fsdp_hooks pushes them on the parameter
    server (fsdp_ps.py). A rank's outer step needs its own shards alone: no all-gather."""

    def __init__(self, compression_params, named, reducer=None):
        self.pushes = PushPullExchange(compression_params, reducer, one_per_host=True,
                                       named_parameters=[(name, local(p)) for name, p in named])
        self.averaged = self.pushes.averaged
        self.server_values, self.set_server_values = self.pushes.server_values, self.pushes.set_server_values

    def start(self, named, copies, ctx):
        """The pseudo-gradients (global copy - local shard) of [(name, parameter)] pushed and
        pulled in the background; a torch Future of {name: average}."""
        return self.pushes(pseudo_gradients(named, copies), ctx=ctx)
