"""FSDP2 on a (2 replicas, 2 shards) gloo mesh under torchrun (4 ranks):
``python fsdp_job.py SPEC.json OUT``. A small MLP trains ``steps`` SGD steps on each rank's own
batches (``micro_batches`` per step, gradients synced on the last). spec "mode":

* "native": HSDP (fully_shard on the 2-D mesh); then register_fsdp_hooks, which must refuse it,
  and refuse a model sharded on mesh["shard"] handed mesh["shard"] as its replicate group;
* "hooked": fully_shard on mesh["shard"] and bps_gc.torch.register_fsdp_hooks on
  mesh["replicate"] with spec "compression_params", recording every hook call's reduce-scatter
  output before and after;
* "resume" (under bps_gc.torch.init()), spec "phase": "first" trains ``stop_at`` steps, saves
  the model and optimizer (torch.distributed.checkpoint, OUT/dcp) and bps_gc.torch.state_dict()
  (OUT/bps<rank>.pt), then trains on to ``steps``; "resumed" builds afresh, loads them and
  trains the rest, then trains a straight run (no checkpoint) in the same process, and hands
  its DTensor parameters to DistributedOptimizer, which must refuse them;
* "fault" (under bps_gc.torch.init()): trains until told to stop, writing OUT/pid<rank> once
  running; rank spec "victim" at step 3 does spec "fault": "kill" (SIGKILL itself), "exit"
  (sys.exit(0)) or "raise".

Each rank saves its full parameters and its local shards, prefixed by the run's name."""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import bps_gc.torch as bps  # noqa: E402
from job_faults import fault_at  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
mode = spec["mode"]
if mode in ("resume", "fault"):
    bps.init()  # the collective communicator: bps.state_dict(), the heartbeat
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def build(hooked=True, hooks=True):
    """The MLP sharded on mesh["shard"] (``hooked``) or on the whole mesh (native HSDP), its
    hooks (the exchange; none unless ``hooked`` and ``hooks``) and its optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 8))
    shard_mesh = mesh["shard"] if hooked else mesh
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    exchange = bps.register_fsdp_hooks(model, mesh["replicate"], spec.get("compression_params")) \
        if hooked and hooks else None
    momentum = 0.9 if mode == "resume" else 0.0  # resume: optimizer state to carry too
    return model, exchange, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def train(model, opt, steps, on_step=None):
    micro_batches = spec.get("micro_batches", 1)  # all but the last under set_requires_gradient_sync(False)
    for step in steps:
        if on_step:
            on_step(step)
        for micro in range(micro_batches):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def parameters(model, prefix=""):
    full = {f"{prefix}full/{name}": p.full_tensor().detach().numpy() for name, p in model.named_parameters()}
    return {**full, **{f"{prefix}local/{name}": p.to_local().detach().numpy() for name, p in model.named_parameters()}}


def record_calls(model, calls):
    """Wrap every module's hook to record (module index, reduce-scatter output in, out)."""
    for index, module in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        param_group = module._get_fsdp_state()._fsdp_param_groups
        if not param_group:
            continue
        inner = param_group[0]._all_reduce_hook

        def recording(reduce_output, inner=inner, index=index):
            before = reduce_output.detach().clone().numpy()
            inner(reduce_output)
            calls.append((index, before, reduce_output.detach().clone().numpy()))
        module.set_all_reduce_hook(recording)


def resume():
    steps, stop_at, ckpt = spec["steps"], spec["stop_at"], os.path.join(out, "dcp")
    model, _, opt = build()
    if spec["phase"] == "first":
        train(model, opt, range(stop_at))
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=ckpt)
        bps.save_checkpoint(bps.state_dict(), os.path.join(out, f"bps{rank}.pt"))
        train(model, opt, range(stop_at, steps))
        return parameters(model, "first/")
    model_sd, opt_sd = get_state_dict(model, opt)
    saved = {"model": model_sd, "optim": opt_sd}
    dcp.load(saved, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    bps.load_state_dict(bps.load_checkpoint(os.path.join(out, f"bps{rank}.pt")))
    train(model, opt, range(stop_at, steps))
    result = parameters(model, "resumed/")
    straight, _, opt = build()
    train(straight, opt, range(steps))
    try:  # a sharded model's DTensors handed to DistributedOptimizer: refused, naming the hooks
        bps.DistributedOptimizer(torch.optim.SGD(straight.parameters(), lr=0.1),
                                 named_parameters=straight.named_parameters())
        refusal = ""
    except TypeError as e:
        refusal = str(e)
    return {**result, **parameters(straight, "straight/"), "refusal": np.array(refusal)}


def fault():
    model, _, opt = build()
    train(model, opt, range(10**6), lambda step: fault_at(step, 3, rank, spec, out))


if mode == "fault":
    fault()
elif mode == "resume":
    np.savez(os.path.join(out, f"{spec['phase']}{rank}.npz"), **resume())
    bps.shutdown()
else:
    calls = []
    model, exchange, opt = build(hooked=mode == "hooked")
    if exchange is not None:
        record_calls(model, calls)
    train(model, opt, range(spec["steps"]))
    refusals = []
    if mode == "native":  # sharded on the 2-D mesh; a replicate group that is not; each refused in one line
        for sharded, replicate in ((model, mesh["replicate"]), (build(hooks=False)[0], mesh["shard"])):
            try:
                bps.register_fsdp_hooks(sharded, replicate)
                refusals.append("")
            except ValueError as e:
                refusals.append(str(e))
    np.savez(os.path.join(out, f"rank{rank}.npz"), **parameters(model),
             **{f"call{i}/in": c[1] for i, c in enumerate(calls)},
             **{f"call{i}/out": c[2] for i, c in enumerate(calls)},
             calls=np.array([c[0] for c in calls]), refusals=np.array(refusals))
    dist.barrier()
    dist.destroy_process_group()
