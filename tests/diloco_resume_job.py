"""bps_gc.torch.DiLoCo stopped in the middle of an H window and resumed, under torchrun with
bps_gc.torch.init(): ``python diloco_resume_job.py SPEC.json OUT``. spec "phase": "straight"
(all ``steps``), "first" (``stop_at`` steps, then save the model, the optimizer and
bps_gc.torch.state_dict() to OUT/ckpt<rank>.pt, then train on to ``steps``) or "resumed" (load
them, then the rest). Each rank saves its parameters at the end, and "first" at ``stop_at`` too.
With spec "warm" (DiLoCo's warm_steps and warm_every), a second model and DiLoCo with those
settings train in lockstep with the first ("warm/<name>"), in the same checkpoint.
"fault": trains until stopped, writing OUT/pid<rank> at step 2; rank spec "victim" at step 5
(an exchange in flight) does spec "fault": "kill" (SIGKILL itself), "exit" or "raise"."""
import gc
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import bps_gc.torch as bps  # noqa: E402
from job_faults import fault_at  # noqa: E402
from test_diloco import batch, build_model  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
bps.init()
rank = bps.rank()


def diloco(**warm):
    model = build_model()
    return model, bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), spec["sync_every"],
                             fragments=spec["fragments"], compression_params=spec["compression_params"],
                             delay=spec["delay"], **warm)


runs = {"": diloco(), **({"warm/": diloco(**spec["warm"])} if "warm" in spec else {})}
path = os.path.join(out, f"ckpt{rank}.pt")
start, stop = 0, spec["steps"]


if spec["phase"] == "fault":
    stop = 10**6
if spec["phase"] == "resumed":
    saved = torch.load(path, weights_only=True)
    for label, (model, opt) in runs.items():
        model.load_state_dict(saved[f"{label}model"])
        opt.load_state_dict(saved[f"{label}diloco"])
    bps.load_state_dict(saved["bps_gc"])
    start = spec["stop_at"]

def save_parameters(name):
    np.savez(os.path.join(out, f"{name}{rank}.npz"), **{f"{label}{n}": p.detach().numpy() for label, (model, _) in
                                                        runs.items() for n, p in model.named_parameters()})


for step in range(start, stop):
    if spec["phase"] == "fault":
        fault_at(step, 5, rank, spec, out)
    x, y = batch(rank, step)
    for model, opt in runs.values():
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if spec["phase"] == "first" and step + 1 == spec["stop_at"]:  # DiLoCo's states first: they wait
        state = {f"{label}{k}": v for label, (model, opt) in runs.items()
                 for k, v in (("model", model.state_dict()), ("diloco", opt.state_dict()))}
        torch.save({**state, "bps_gc": bps.state_dict()}, path)
        save_parameters("first")
save_parameters("first_end" if spec["phase"] == "first" else spec["phase"])
for _, opt in runs.values():
    opt.wait()  # its last exchange may be in flight: a gloo work pending at exit can abort the process
del opt, runs
gc.collect()
bps.shutdown()
