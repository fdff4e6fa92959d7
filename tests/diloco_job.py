"""bps_gc.torch.DiLoCo under torchrun: ``python diloco_job.py SPEC.json OUT``. For each case
of the spec (sync_every, fragments, steps), a small MLP trains with inner SGD on each rank's
own batches, the outer step on the workers; each rank saves its final parameters."""
import gc
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import bps_gc.torch as bps  # noqa: E402
from test_diloco import batch, build_model  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
saved = {}
for case, (sync_every, fragments, steps, delay) in spec["cases"].items():
    model = build_model()
    opt = bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every, fragments=fragments,
                     delay=delay)
    for step in range(steps):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    saved.update({f"{case}/{name}": p.detach().numpy() for name, p in model.named_parameters()})
np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)
del opt  # an exchange still in flight (the overlapped case's last), freed before the process group:
gc.collect()  # a gloo work's future freed after destroy_process_group can abort the process at exit
dist.barrier()
dist.destroy_process_group()
