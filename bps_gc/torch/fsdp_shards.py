"""What both replicate reducers of ``register_fsdp_hooks`` take from an FSDP2 model: its
FSDPModules' parameter groups (each refused in one line unless sharded on a 1-D mesh, one
group a module), each parameter's shard as a named part ``<fqn>#shard<i>`` (i: the shard's
index in the shard mesh) with a stand-in tensor of its padded shape, reduce dtype and device,
a reduce-scatter output cut into those parts, and the mesh a checkpoint of their codecs was
saved on (``ShardLayout``)."""
import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule

import bps_gc.core as core

from ..compress.stateful import StateError
from .checkpoint import Fields


def sharded_groups(model):
    """[(FSDPModule, its parameter group)] of ``model``, each refused in one line unless it is
    sharded on a 1-D mesh with one parameter group a module."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("register_fsdp_hooks: the model has no FSDPModule; shard it first with "
                         "fully_shard(module, mesh=mesh['shard'])")
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
    return groups


def shard_parts(model, groups):
    """{id(parameter group): [(``<fqn>#shard<i>``, stand-in tensor)]}: each shard a named part
    whose stand-in tensor (its padded shape, reduce dtype and device) the codec is kept under,
    so a checkpoint's codecs load before the first step (FSDP2 reduces the parameters that have
    gradients: the trainable ones)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {id(param_group): [shard_part(param_group, p, names) for p in param_group.fsdp_params
                              if p.sharded_param.requires_grad] for _, param_group in groups}


def shard_part(param_group, fsdp_param, names):
    """(``<fqn>#shard<i>``, a tensor standing for the reduce-scatter's piece of ``fsdp_param``)."""
    name = names.get(id(fsdp_param.sharded_param))
    if name is None:
        raise ValueError("register_fsdp_hooks: a sharded parameter is not among the model's parameters; "
                         "pass the root module (the one fully_shard was called on last)")
    policy, dtype = param_group.mp_policy, fsdp_param.sharded_param.dtype
    reduce_dtype = policy.reduce_dtype or policy.param_dtype or dtype  # FSDP2's rule
    # one element seen in the shard's shape: what the exchange reads of it (its size, shape,
    # dtype and device) without holding a shard's worth of memory
    stand_in = torch.empty((), dtype=reduce_dtype, device=param_group.device).expand(
        tuple(fsdp_param.padded_sharded_param_size))
    return f"{name}#shard{param_group.mesh_info.shard_mesh_rank}", stand_in


class ShardLayout:
    """The mesh a checkpoint of the hooks' codecs was saved on, (replicas, shards), and this
    rank's shard index: the codec state is per shard, so loading it on another mesh is refused,
    naming both (start the codecs afresh by not loading bps_gc's state: docs/fsdp.md). With
    ``dense_steps``, also each hooked parameter group's dense averages so far (``dense_done``),
    saved so that a resumed job switches to the codec at the same step as a straight one."""

    def __init__(self, replicas, shards, shard, dense_steps=0, groups=0):
        self.identity = {"mesh": f"({replicas}, {shards})", "shard": shard}
        self.dense_steps = dense_steps
        self.dense_done = np.zeros(groups if dense_steps else 0, np.int64)  # none held without

    def codec_state(self):
        return Fields(self, ("dense_done",) if self.dense_steps else (), self.identity)

    def codec_state_to_load(self, sd):
        saved = (sd.get("identity.mesh"), sd.get("identity.shard"))
        if saved != (self.identity["mesh"], self.identity["shard"]):
            raise StateError(f"register_fsdp_hooks: the codec state was saved on the mesh (replicas, shards) "
                             f"{saved[0]} as shard {saved[1]}, and this rank is shard {self.identity['shard']} of "
                             f"{self.identity['mesh']}; the codecs are per shard: load the model and optimizer "
                             "alone to start them afresh")
        return self.codec_state(), lambda: None


def shard_pieces(reduce_output, parts):
    """[(name, view)]: a parameter group's reduce-scatter output cut into the views of its
    parameters' shards (``parts``: [(name, stand-in tensor)], in the group's order), each in
    its shape (PowerSGD's matrix); refused in one line if it does not fit them."""
    sizes = [stand_in.numel() for _, stand_in in parts]
    if reduce_output.numel() != sum(sizes):
        raise RuntimeError(f"bps_gc register_fsdp_hooks: a reduce-scatter output of {reduce_output.numel()} "
                           f"elements, but its shards hold {sum(sizes)} (a parameter without a gradient "
                           "this step?)")
    if (reduce_output.dtype, reduce_output.device) != (parts[0][1].dtype, parts[0][1].device):
        raise RuntimeError(f"bps_gc register_fsdp_hooks: a reduce-scatter output of {reduce_output.dtype} on "
                           f"{reduce_output.device}, where the MixedPrecisionPolicy gives "
                           f"{parts[0][1].dtype} on {parts[0][1].device}")
    return [(name, piece.view(stand_in.shape))
            for (name, stand_in), piece in zip(parts, reduce_output.split(sizes))]


def unfit_codec(compressor, reduce_dtype, name, problem, setting="compressor"):
    """The one-line refusal of a codec (of ``setting``) that cannot take the reduce dtype of
    shard ``name`` (``problem``: the codec's TypeError), on either transport."""
    where = "compressor" if setting == "compressor" else f"{setting}' compressor"
    return (f"register_fsdp_hooks: {where} {compressor!r} cannot take the reduce dtype {reduce_dtype} of "
            f"{name!r} ({problem}); set fully_shard's mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32) "
            "or choose a codec that carries it")


def refuse_unfit_codec(exchange, parts, setting="compressor"):
    """Refuse, before any step, a codec that cannot take the reduce dtype of some shard (float64,
    for TernGrad, QSGD, sign...: docs/ddp_hook.md "Dtypes"; bfloat16 and float16 are widened to
    float32 for every codec), one line naming the codec (of ``setting``), the dtype and a shard of it."""
    params, checked = exchange.hook.params, set()
    if not params.compressor:
        return
    for name, stand_in in parts:
        if stand_in.dtype in checked:
            continue
        checked.add(stand_in.dtype)
        problem = exchange.hook.pipeline.codecs.refusal(name, stand_in, core.device_codecs())
        if problem:
            raise TypeError(unfit_codec(params.compressor, stand_in.dtype, name, problem, setting))
