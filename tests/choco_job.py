"""Decentralized training with bps_gc.torch.DecentralizedOptimizer on real processes: each rank
trains a small Linear model from its own initial weights and saves, per round, its gradients
and parameters, then the averaged parameters and its gossip bytes.
``python tests/choco_job.py SPEC OUT [gloo]``: the messages go through bps_gc's parameter-server
runtime (bpslaunch), or with ``gloo`` through its torch.distributed transport (bpslaunch --servers
0, which bps_gc.init() detects: bps_gc.collective's isend/irecv). With ``gloo`` the spec may hold
"jobs" [{"configs", "out", "workers"}] instead of "configs": one job after the other in one launch
(its processes start once), each on ranks 0..workers-1 of it, in a gloo group of their own that
bps_gc's init() adopts (gloo_group.init_job_group); the other ranks skip it. A config
with "die_rank"/"die_step" makes that rank exit abruptly there (its neighbours must stop
naming it). Once its results are saved it prints SAVED; with "until_killed" in the spec it then
trains a CHOCO ring on (printing RUNNING at its third round) until the test kills a rank and
the others fail naming it."""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.torch as bps  # noqa: E402

spec = json.load(open(sys.argv[1]))


def train(configs, rank):
    """Each config on this job's ranks: {name/init|step/grad|step/param|average/...: array}."""
    saved = {}
    for cfg in configs:
        name = cfg["name"]
        torch.manual_seed(100 + rank)  # different initial models
        model = torch.nn.Linear(4, 6)
        named = [(f"{name}.{n}", p) for n, p in model.named_parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
        opt = bps.DecentralizedOptimizer(opt, named, algorithm=cfg["algorithm"], topology=cfg["graph"],
                                         consensus_stepsize=cfg.get("gamma", 1.0),
                                         compression_params=cfg.get("params"), name=name)
        for n, p in named:
            saved[f"{name}/init/{n}"] = p.detach().numpy().copy()
        rng = np.random.default_rng([rank, 7])
        for step in range(cfg["steps"]):
            if cfg.get("die_rank") == rank and cfg.get("die_step") == step:
                print(f"rank {rank} dies now", flush=True)
                os._exit(3)
            for n, p in named:
                g = (np.zeros(p.shape, np.float32) if cfg.get("zero_grads")
                     else rng.standard_normal(p.shape).astype(np.float32))
                saved[f"{name}/{step}/grad/{n}"] = g
                p.grad = torch.from_numpy(g.copy())
            opt.step()
            for n, p in named:
                saved[f"{name}/{step}/param/{n}"] = p.detach().numpy().copy()
        opt.finish()
        for n, value in opt.averaged_parameters().items():
            saved[f"{name}/average/{n}"] = value.numpy().copy()
        saved[f"{name}/bytes_sent"] = np.array(opt.bytes_sent())
    return saved


if sys.argv[3:] == ["gloo"] and "jobs" in spec:
    import torch.distributed as dist
    from gloo_group import init_job_group
    for i, job in enumerate(spec["jobs"]):
        if not init_job_group(i, job["workers"]):
            continue
        bps.init()
        rank = bps.rank()
        saved = train(job["configs"], rank)
        np.savez(os.path.join(job["out"], f"choco{rank}.npz"), **saved)
        bps.shutdown()
        dist.destroy_process_group()
    sys.exit(0)
bps.init()  # the transport follows the launcher: bpslaunch --servers 0 -> torch.distributed
rank, size = bps.rank(), bps.size()
saved = train(spec["configs"], rank)
np.savez(os.path.join(sys.argv[2], f"choco{rank}.npz"), **saved)
print("SAVED", flush=True)
if spec.get("until_killed"):
    torch.manual_seed(rank)
    model = torch.nn.Linear(64, 64)
    opt = bps.DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                     [(f"killed.{n}", p) for n, p in model.named_parameters()],
                                     topology="ring", consensus_stepsize=0.3,
                                     compression_params={"compressor": "topk", "k": 8}, name="killed")
    for step in range(10 ** 6):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        if step == 2:
            print("RUNNING", flush=True)
bps.shutdown()
