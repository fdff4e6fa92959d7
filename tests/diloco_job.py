"""bps_gc.torch.DiLoCo under torchrun: ``python diloco_job.py SPEC.json OUT``. For each case
of the spec (sync_every, fragments, steps), a small MLP trains with inner SGD on each rank's
own batches, the outer step on the workers; each rank saves its final parameters and the bytes
bps_gc.torch.metrics() counted for the case (pushed_wire). Then the spec's "bytes" run: thc
4-bit pseudo-gradients of a wider MLP, every ``sync_every`` steps, and its counted bytes. Then
the spec's "study": scripts/diloco_quality.py's tiny LM trained as its replica ``rank`` would
be, with a warm phase, through bps_gc.torch.DiLoCo; its global copy is saved ("study/<name>").
Last, with spec "straight", diloco_resume_job.py's straight phase with that spec, in the same
processes (OUT/straight<rank>.npz): test_diloco's resume test without a launch of its own."""
import gc
import json
import os
import runpy
import sys

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import bps_gc.torch as bps  # noqa: E402
from test_diloco import batch, build_model, build_wide_model, wide_batch  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
saved = {}
for case, (sync_every, fragments, steps, delay, warm_steps, warm_every) in spec["cases"].items():
    model = build_model()
    opt = bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every, fragments=fragments,
                     delay=delay, warm_steps=warm_steps, warm_every=warm_every)
    bps.metrics()  # reset: the case's own exchanges are counted below
    for step in range(steps):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    saved.update({f"{case}/{name}": p.detach().numpy() for name, p in model.named_parameters()})
    saved[f"{case}/pushed_wire"] = np.array(bps.metrics().pushed_wire)
    saved[f"{case}/outer_step"] = np.array(opt.outer_step)  # the default without bps_gc's init: the workers'
opt.state_dict()  # waits for the overlapped case's last exchange, still in flight
counted = spec["bytes"]
model = build_wide_model()
opt = bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), counted["sync_every"],
                 compression_params=counted["compression_params"])
bps.metrics()
for step in range(counted["steps"]):
    x, y = wide_batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
saved["bytes/pushed_wire"] = np.array(bps.metrics().pushed_wire)
opt.wait()
study = spec["study"]  # scripts/diloco_quality.py's warm phase and DiLoCo, as its replicas train
sys.path[:0] = [os.path.join(ROOT, "scripts")] + [os.path.join(ROOT, "example", p) for p in ("pytorch/lm", "pytorch")]
from diloco_quality import Study, parse_args  # noqa: E402
from gpt import byte_loss  # noqa: E402
from lm_training import build_model as build_lm, make_optimizer  # noqa: E402
lm = Study(parse_args(study["argv"]))
run = lm.settings(study["steps"])
model = build_lm(run, torch.device("cpu"))
opt = bps.DiLoCo(model, make_optimizer(run, model), study["every"], warm_steps=study["warm"],
                 warm_every=study["warm_every"], outer_optimizer=lambda params: torch.optim.SGD(
                     params, lr=study["outer_lr"], momentum=0.9, nesterov=True))
for step in range(study["steps"]):
    lm.set_lr(opt, run, step)
    opt.zero_grad()
    x, y = lm.batch(rank, step)
    byte_loss(model(x), y).backward()
    lm.clipped_step(model, opt, run.clip)
names = [name for name, _ in model.named_parameters()]
saved.update({f"study/{name}": copy.numpy() for name, copy in zip(names, (c for f in opt.fragments for c in f.copies))})
np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)
opt.wait()  # an exchange may be in flight: a gloo work pending at exit can abort the process
del opt
gc.collect()
if "straight" in spec:  # its bps.init() adopts this process group, its bps.shutdown() leaves it
    # each rank's own file: one shared file was truncated by one rank's open() while the other
    # read it (an empty spec: JSONDecodeError on rank 0, once in a full suite)
    straight = os.path.join(out, f"straight-rank{rank}.json")
    with open(straight, "w") as f:
        json.dump({**spec["straight"], "phase": "straight"}, f)
    sys.argv = [os.path.join(ROOT, "tests", "diloco_resume_job.py"), straight, out]
    runpy.run_path(sys.argv[0], run_name="__main__")
dist.barrier()
dist.destroy_process_group()
