"""FSDP2 with the parameter server as the replicate reducer, under ``bpslaunch`` (hosts x local
ranks): ``python fsdp_ps_job.py SPEC.json OUT``. Each rank joins (bps.init()), makes the host's
group (bps.host_mesh()), and trains one MLP per spec "runs" entry (name: compression_params,
null: dense), sharded over the host's local ranks and hooked with register_fsdp_hooks(model,
None, params), ``steps`` SGD steps on its own batches (spec "widths": the MLP's, default
16-32-32-8). Saved per run, prefixed "<run>/": the full parameters at the end, its local
shards after every step, every hook call's reduce-scatter output before and after, the
partitions (key, start, stop) of each shard's declared tensor, the bytes bps.metrics() counted
and the codec state bps_gc's state_dict holds of them. Then a model sharded on a mesh that is
not the host's must be refused ("refusal"), as register_fsdp_hooks(model, None) before
bps.init() ("unserved").

Spec "save" {"run": name, "at": k}: that run's shards (OUT/model<rank>.npz) and bps_gc's state
(OUT/bps<rank>.pt) are saved before its step k (make it the first run: the state holds the
runs declared so far). Spec "resume" {"from": DIR, "at": k, "runs": {name: params}, "codecs":
bool, "refused": bool}: those runs are trained first, from step k after loading DIR's shards and
(unless "codecs" is false) bps_gc's state; their arrays in OUT/resumed<rank>.npz ("refused":
DIR is another mesh's, whose state must be refused: its message, "<run>/refused", instead). Spec "fault"
(tests/job_faults.py: "victim", "fault"): after the runs, top-k + EF trains until the victim's
fault."""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import bps_gc.core as core  # noqa: E402
import bps_gc.torch as bps  # noqa: E402
from bps_gc.compress.stateful import StateError  # noqa: E402
from job_faults import fault_at  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
torch.set_num_threads(1)
WIDTHS = tuple(spec.get("widths", (16, 32, 32, 8)))


def build(shard_mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[1], WIDTHS[2]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[2], WIDTHS[3]))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


# before bps.init(): a model sharded on a group of this process alone, hooked with replicate=None
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    bps.register_fsdp_hooks(build(DeviceMesh.from_group(dist.group.WORLD, "cpu")), None)
    unserved = ""
except ValueError as e:
    unserved = str(e)
dist.destroy_process_group()
bps.init()
rank = bps.rank()
mesh = bps.host_mesh()


def batch(step):
    """Rank ``rank``'s batch of ``step`` (the test recomputes it)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, WIDTHS[0], generator=g), torch.randn(4, WIDTHS[-1], generator=g)


def record_calls(model, calls):
    """Wrap every module's hook to record (module index, reduce-scatter output in, out)."""
    for index, module in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        groups = module._get_fsdp_state()._fsdp_param_groups
        if not groups:
            continue
        inner = groups[0]._all_reduce_hook

        def recording(reduce_output, inner=inner, index=index):
            before = reduce_output.detach().clone().numpy()
            inner(reduce_output)
            calls.append((index, before, reduce_output.detach().clone().numpy()))
        module.set_all_reduce_hook(recording)


def run(name, params, first=0, resume=None):
    """Train run ``name`` from step ``first`` (after ``resume``'s checkpoint, spec "resume")."""
    model = build(mesh)
    exchange = bps.register_fsdp_hooks(model, None, params)
    calls, arrays = [], {}
    record_calls(model, calls)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if resume:  # the shards and bps_gc's state saved at step ``first`` (plain SGD: no optimizer state)
        if resume.get("refused"):  # saved on another mesh: bps_gc's state must be refused
            try:
                bps.load_state_dict(bps.load_checkpoint(os.path.join(resume["from"], f"bps{rank}.pt")))
            except StateError as e:
                return {f"{name}/refused": np.array(str(e))}
            raise AssertionError(f"rank {rank}: the state of {resume['from']} was loaded on another mesh")
        saved = np.load(os.path.join(resume["from"], f"model{rank}.npz"))
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.to_local().copy_(torch.from_numpy(saved[n]))
        if resume.get("codecs", True):  # False: the codecs start afresh (the check that they matter)
            bps.load_state_dict(bps.load_checkpoint(os.path.join(resume["from"], f"bps{rank}.pt")))
    bps.metrics()  # from here: this run's bytes
    for step in range(first, spec["steps"]):
        if (name, step) == (spec.get("save", {}).get("run"), spec.get("save", {}).get("at")):
            np.savez(os.path.join(out, f"model{rank}.npz"),
                     **{n: p.to_local().detach().numpy() for n, p in model.named_parameters()})
            bps.save_checkpoint(bps.state_dict(), os.path.join(out, f"bps{rank}.pt"))
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        arrays.update({f"local/{step}/{n}": p.to_local().detach().numpy().copy() for n, p in model.named_parameters()})
    counted = bps.metrics()
    arrays.update({f"full/{n}": p.full_tensor().detach().numpy() for n, p in model.named_parameters()})
    arrays.update({f"call{i}/in": c[1] for i, c in enumerate(calls)})
    arrays.update({f"call{i}/out": c[2] for i, c in enumerate(calls)})
    arrays["calls"] = np.array([c[0] for c in calls])
    comm = core.communicator()
    for part, declared in exchange.keys.items():
        arrays[f"keys/{part}"] = np.array([(p.key, p.start, p.stop) for p in comm.tensors[declared].partitions],
                                          np.uint64).reshape(-1, 3)
        arrays[f"shape/{part}"] = np.array(comm.tensors[declared].shape)
    arrays["pushed_wire"], arrays["pulled_wire"] = np.array(counted.pushed_wire), np.array(counted.pulled_wire)
    # the codec state of this run's shards this rank saves: its own chains' ("worker/"), and
    # (host 0's ranks) the servers' of the same shards ("server/")
    declared, state = set(exchange.keys.values()), core.state_dict()
    for side in ("worker", "server"):
        arrays[f"state_{side}"] = np.array(sum(v.nbytes for k, v in state.items() if isinstance(v, np.ndarray)
                                               and k.startswith(f"{side}/") and k.split("/")[1] in declared))
    return {f"{name}/{k}": v for k, v in arrays.items()}


if "resume" in spec:  # spec "resume" {"from": DIR, "at": k, "runs": {name: params}, "codecs": bool}
    resumed = {}
    for name, params in spec["resume"]["runs"].items():
        resumed.update(run(name, params, spec["resume"]["at"], spec["resume"]))
    np.savez(os.path.join(out, f"resumed{rank}.npz"), **resumed)
arrays = {"unserved": np.array(unserved)}
for name, params in spec["runs"].items():
    arrays.update(run(name, params))
# a model sharded on a mesh other than the host's local ranks (each rank alone): refused
alone = [dist.new_group([r]) for r in range(bps.local_size())][bps.local_rank()]
try:
    bps.register_fsdp_hooks(build(DeviceMesh.from_group(alone, "cpu")), None)
    arrays["refusal"] = np.array("")
except ValueError as e:
    arrays["refusal"] = np.array(str(e))
np.savez(os.path.join(out, f"rank{rank}.npz"), **arrays)
if "fault" in spec:  # train until told to stop; rank spec "victim" does spec "fault" at step 3
    model = build(mesh)
    bps.register_fsdp_hooks(model, None, {"compressor": "topk", "k": 0.25, "ef": "vanilla"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10**6):
        fault_at(step, 3, rank, spec, out)
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
bps.shutdown()
