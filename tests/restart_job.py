"""Tiny training jobs run straight with a checkpoint half way, and resumed from it in new
processes (tests/test_restart_state.py). ``python restart_job.py SPEC OUT PHASE`` under torchrun
or bpslaunch:

PHASE "first": spec["steps"] steps, writing a checkpoint (bps_gc.torch.save_checkpoint) after
spec["save_at"] (the straight run: saving changes nothing); "second": new processes load it and
run the rest; "elastic": under torchrun --max-restarts, a checkpoint every spec["every"] steps,
rank spec["kill_rank"] kills itself (SIGKILL) at spec["kill_step"] on the first attempt
(TORCHELASTIC_RESTART_COUNT 0), and every rank of the next attempt resumes from the
checkpoint. Each rank writes its final parameters to OUT/<PHASE>-rank<r>.npz, as
``<case>/<parameter>``. With spec["kill_at"], the first phase ends at once (os._exit, no
shutdown) after that step's checkpoint.

All of spec["cases"] train side by side in the same processes, each its own model (parameters
named ``<case>.<...>``) and binding: "hook" (DDP and bps_gc.torch.comm_hook), "optimizer"
(DistributedOptimizer), "local_sgd", "choco"; ``compression_params`` the codec,
``bucket_cap_mb_second`` another DDP bucket size after the restart. The checkpoint holds
bps_gc.torch.state_dict() and every optimizer's own state_dict(), the codec state riding too
(under "bps_gc") in one optimizer of each wrapping kind (``carriers``). PHASE "without_state" is
"second" loading neither (the failure the test must see). PHASE may list phases,
"second,without_state,device:second": each runs in turn in the same processes, bps_gc
initialised and shut down again for each on the process group the job made first (adopted:
bps_gc.collective.rendezvous.adopt), so a later one starts with no codec state but what it loads
(one launch, not one a phase); "device:" runs the phase with the torch codec chains
(BPS_GC_DEVICE_CODECS=torch) in OUT/device. The last phase may be "state_errors" (under
bpslaunch): rank 0 alone, a job of 1 rank, loads states that do not fit, and the 2-rank
checkpoint OUT/checkpoint-run-rank0.pt (tests/state_errors.py).
"""
import json
import os
import sys

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.torch as bps  # noqa: E402
from bps_gc.torch.checkpoint import codec_state_left_out  # noqa: E402

spec, out, phases = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3].split(",")
if len(phases) > 1:  # bps_gc inits and shuts down once a phase on this group
    import torch.distributed as dist
    from gloo_group import init_default_group, init_job_group
    if "RANK" in os.environ:  # torchrun
        init_default_group()
    else:  # bpslaunch: the launch's jobs, each a group of its own (state_errors: 1 rank)
        init_job_group(0, int(os.environ["DMLC_NUM_WORKER"]))


class Named(torch.nn.Module):
    """A small MLP whose parameters are named ``<case>.<i>.weight``: a declared name per case."""

    def __init__(self, name):
        super().__init__()
        self.name = name
        self.add_module(name, torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 30)))

    def forward(self, x):
        return getattr(self, self.name)(x)


def binding(name, case, phase):
    torch.manual_seed(0)
    net = Named(name)
    params = case.get("compression_params") or {}
    base = torch.optim.SGD(net.parameters(), lr=0.1, momentum=case.get("momentum", 0.9))
    kind = case["case"]
    if kind == "hook":
        cap = case.get("bucket_cap_mb_second", 0.002) if phase == "second" else 0.002
        model = DDP(net, bucket_cap_mb=cap)
        model.register_comm_hook(None, bps.comm_hook(params, optimizer=base, named_parameters=net.named_parameters()))
        return net, model, base
    if kind == "optimizer":
        opt = bps.DistributedOptimizer(base, named_parameters=net.named_parameters(), compression_params=params)
    elif kind == "local_sgd":
        opt = bps.LocalSGD(base, net.named_parameters(), local_steps=2, compression_params=params)
    else:
        opt = bps.DecentralizedOptimizer(base, net.named_parameters(), "choco", compression_params=params, name=name)
    return net, net, opt


def carriers(cases):
    """The cases whose optimizer's state_dict() carries the codec state: one of each wrapping
    kind (DistributedOptimizer: onebit + EF + nesterov where it runs, LocalSGD, CHOCO). Each
    carries the whole rank's state (bps.state_dict()), which bps.load_state_dict(), loaded last,
    restores again: a copy in all 16 made each rank's checkpoint 4 MB and its load 0.7 s of CPU."""
    first = {}
    for name, case in cases.items():
        if case["case"] != "hook" and (case["case"] not in first or name == "onebit_ef_nesterov"):
            first[case["case"]] = name
    return set(first.values())


CARRIERS = carriers(spec["cases"])


def optimizer_state(name, opt):
    if name in CARRIERS:
        return opt.state_dict()
    with codec_state_left_out():  # what broadcast_optimizer_state saves: the optimizer's own
        return opt.state_dict()


def run(phase, out):
    """One phase: every case trained from step 0 or from the checkpoint, its parameters saved in ``out``."""
    bps.init()
    rank = bps.rank()
    runs = {name: binding(name, case, phase) for name, case in spec["cases"].items()}
    checkpoint = os.path.join(out, f"checkpoint-{'elastic' if phase == 'elastic' else 'run'}-rank{rank}.pt")
    first = 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    drop_codec_state = phase == "without_state"
    if phase in ("second", "without_state") or (phase == "elastic" and os.path.exists(checkpoint)):
        saved = bps.load_checkpoint(checkpoint)
        for name, (_, model, opt) in runs.items():
            model.load_state_dict(saved["models"][name])
            state = saved["optimizers"][name]
            opt.load_state_dict({k: v for k, v in state.items() if k != "bps_gc"} if drop_codec_state else state)
        if not drop_codec_state:
            bps.load_state_dict(saved["bps_gc"])
        first = saved["step"]
    with open(os.path.join(out, f"{phase}-attempt{attempt}-rank{rank}.txt"), "w") as f:
        f.write(str(first))  # the step this attempt started from
    for step in range(first, spec["save_at"] if spec.get("kill_at") else spec["steps"]):
        if phase == "elastic" and attempt == 0 and rank == spec["kill_rank"] and step == spec["kill_step"]:
            os.kill(os.getpid(), 9)  # kill -9, mid-epoch: torch elastic restarts the group
        for index, (name, (_, model, opt)) in enumerate(runs.items()):
            g = torch.Generator().manual_seed(1000 * rank + 100 * index + step)
            x, y = torch.randn(6, 12, generator=g) + rank, torch.randn(6, 30, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if (phase == "first" and step + 1 == spec["save_at"]) or \
                (phase == "elastic" and (step + 1) % spec["every"] == 0):
            bps.save_checkpoint({"models": {name: model.state_dict() for name, (_, model, _) in runs.items()},
                                 "optimizers": {name: optimizer_state(name, opt) for name, (_, _, opt) in runs.items()},
                                 "bps_gc": bps.state_dict(), "step": step + 1}, checkpoint)
            bps.barrier()  # every rank's checkpoint of this step is written before any goes on
    if phase == "first" and spec.get("kill_at"):
        bps.barrier()  # every rank's checkpoint is written
        os._exit(0)  # no shutdown: the processes just end
    for _, _, opt in runs.values():
        if hasattr(opt, "finish"):  # CHOCO: the messages in flight
            opt.finish()
    np.savez(os.path.join(out, f"{phase}-rank{rank}.npz"),
             **{f"{name}/{key}": p.detach().numpy() for name, (net, _, _) in runs.items()
                for key, p in net.named_parameters()})
    bps.barrier()
    bps.shutdown()


for phase in phases:
    if phase == "state_errors":  # the last phase, on rank 0 alone: bpslaunch only
        from state_errors import refuse_states
        dist.destroy_process_group()
        if init_job_group(1, 1):
            bps.init()
            refuse_states(out, os.path.join(out, "checkpoint-run-rank0.pt"))  # a 2-rank checkpoint
            bps.barrier()
            bps.shutdown()
        break
    device = phase.startswith("device:")
    if device:  # read by bps.init(): this phase's chains only
        os.environ["BPS_GC_DEVICE_CODECS"] = "torch"
        os.makedirs(os.path.join(out, "device"), exist_ok=True)
    run(phase.removeprefix("device:"), os.path.join(out, "device") if device else out)
    if device:
        del os.environ["BPS_GC_DEVICE_CODECS"]
