"""FSDP2 on a (2 replicas, 2 shards) gloo mesh under torchrun (4 ranks):
``python fsdp_job.py SPEC.json OUT``. spec "mode": "native" (HSDP: fully_shard on the 2-D
mesh) or "hooked" (fully_shard on mesh["shard"] and bps_gc.torch.register_fsdp_hooks on
mesh["replicate"] with spec "compression_params"). A small MLP trains ``steps`` SGD steps on
each rank's own batches (``micro_batches`` per step, gradients synced on the last); each rank saves its full parameters, its local shards and, when
hooked, every hook call's reduce-scatter output before and after."""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import bps_gc.torch as bps  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 8))
shard_mesh = mesh if spec["mode"] == "native" else mesh["shard"]
for layer in (model[0], model[2], model[4]):
    fully_shard(layer, mesh=shard_mesh)
fully_shard(model, mesh=shard_mesh)
calls = []
if spec["mode"] == "hooked":
    bps.register_fsdp_hooks(model, mesh["replicate"], spec.get("compression_params"))
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
opt = torch.optim.SGD(model.parameters(), lr=0.1)
micro_batches = spec.get("micro_batches", 1)  # all but the last under set_requires_gradient_sync(False)
for step in range(spec["steps"]):
    for micro in range(micro_batches):
        g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
        model.set_requires_gradient_sync(micro == micro_batches - 1)
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
refusal = ""
if spec["mode"] == "native":  # sharded on the 2-D mesh: the hooks are refused, in one line
    try:
        bps.register_fsdp_hooks(model, mesh["replicate"])
    except ValueError as e:
        refusal = str(e)
full = {name: p.full_tensor().detach().numpy() for name, p in model.named_parameters()}
local = {name: p.to_local().detach().numpy() for name, p in model.named_parameters()}
np.savez(os.path.join(out, f"rank{rank}.npz"), **{f"full/{k}": v for k, v in full.items()},
         **{f"local/{k}": v for k, v in local.items()},
         **{f"call{i}/in": c[1] for i, c in enumerate(calls)}, **{f"call{i}/out": c[2] for i, c in enumerate(calls)},
         calls=np.array([c[0] for c in calls]), refusal=np.array(refusal))
dist.barrier()
dist.destroy_process_group()
