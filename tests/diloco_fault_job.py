"""A worker of tests/test_diloco_ps_faults.py: bps_gc.torch.DiLoCo on the parameter server,
two runs trained in lockstep, one with the outer step on the servers and one on the workers
(top-k + EF, H = 4, two staggered fragments, tau = 1: after every even step one fragment's
exchange is in flight), on the small MLP of test_diloco.py, for up to 60 s.

Prints "RUNNING" after step 2. After step 6, which starts fragment 0's exchange, the victim
(env VICTIM, a rank) does env FAULT: "stall" (prints "IN FLIGHT", then waits until the file
OUT/go exists: the other worker takes two more steps and waits on fragment 1's exchange, which
the victim has not pushed to), or job_faults.fault_at's "exit" (its script returns early:
sys.exit(0), no shutdown) or "kill" (SIGKILL itself), writing OUT/fault_time. OUT: env OUT.

Env REPLICATE=hosts (one bpslaunch per host with local ranks): each host's local ranks train
one replica (replicate="hosts", DDP on the host's group, each rank its own batch), VICTIM
then being a global rank; FAULT "stall-step" stalls as "stall" does, but in step 7, before the
first run's opt.step (fragment 0's outer step: its host's other ranks wait for it in the
all-gather of the parts)."""
import os
import time

import torch

import bps_gc.torch as bps
from job_faults import fault_at
from test_diloco import batch, build_model

TOPK = {"compressor": "topk", "k": 0.3, "ef": "vanilla"}

bps.init()
rank = bps.rank()
spec, out = {"victim": int(os.environ.get("VICTIM", "-1")), "fault": os.environ.get("FAULT")}, os.environ["OUT"]
hosts = os.environ.get("REPLICATE") == "hosts"
runs = []
for mode in ("servers", "workers"):
    model = build_model()
    # DDP's all-reduce on the host's group keeps the host's ranks one replica
    replica = torch.nn.parallel.DistributedDataParallel(model, process_group=bps.host_group()) if hosts else model
    runs.append((replica, bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), 4, fragments=2, delay=1,
                                     compression_params=TOPK, outer_step=mode,
                                     **({"replicate": "hosts"} if hosts else {}))))


def stall():
    print("IN FLIGHT", flush=True)
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.05)


deadline = time.monotonic() + 60
step = 0
while time.monotonic() < deadline:
    x, y = batch(rank, step)
    for n, (model, opt) in enumerate(runs):
        torch.nn.functional.mse_loss(model(x), y).backward()
        if spec["fault"] == "stall-step" and rank == spec["victim"] and step == 6 and n == 0:
            stall()  # before the step that all-gathers fragment 0's outer step over the host
        opt.step()
        opt.zero_grad()
    step += 1
    if step == 2:
        print("RUNNING", flush=True)
    if spec["fault"] == "stall" and rank == spec["victim"] and step == 6:
        stall()
    elif spec["fault"] in ("kill", "exit"):
        fault_at(step, 6, rank, spec, out)
    time.sleep(0.01)
print("DONE", step, flush=True)
for _, opt in runs:
    opt.wait()
bps.shutdown()
