"""bps_gc.torch.DiLoCo on the parameter server (under ``bpslaunch --local``), the outer step on
the workers: ``python diloco_ps_job.py SPEC.json OUT``. Phase "all": each dense case of the spec
(sync_every, fragments, steps, delay) trains the small MLP with inner SGD on each rank's own
batches; then the compressed run ("compressed": top-k + EF, two staggered fragments, tau = 1)
twice: "straight", and "first", which at ``stop_at`` saves the model, DiLoCo's state and
bps_gc.torch.state_dict() to OUT/ckpt<rank>.pt (a fragment's exchange in flight) and trains on
("first_end"), after trying a DiLoCo with a process group (refused: "refused"); the straight run's global copies too ("global"). Phase "dense": the dense cases
only. Phase "resumed": the same objects made in the same order (so the same names are
declared), the checkpoint loaded, the rest trained ("resumed"). Each rank saves OUT/<phase><rank>.npz."""
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import bps_gc.torch as bps  # noqa: E402
from test_diloco import batch, build_model  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
bps.init()
rank = bps.rank()
resumed = spec["phase"] == "resumed"
saved = {}


def train(model, opt, start, stop, on_step=None):
    for step in range(start, stop):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if on_step:
            on_step(step + 1)


def parameters(model, label):
    saved.update({f"{label}/{name}": p.detach().numpy().copy() for name, p in model.named_parameters()})


if spec["phase"] == "all":  # a process group on the parameter server: refused, nothing declared
    model = build_model()
    try:
        bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), 4, replicate="a group")
    except ValueError as e:
        saved["refused"] = np.array(str(e))
keep = []  # every DiLoCo made (a resumed job makes them all again, declaring the same names)
for case, (sync_every, fragments, steps, delay) in spec["cases"].items():
    model = build_model()
    keep.append(bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every, fragments=fragments,
                           delay=delay))
    if not resumed:
        train(model, keep[-1], 0, steps)
        parameters(model, case)


def finish():
    np.savez(os.path.join(out, f"{spec['phase']}{rank}.npz"), **saved)
    for opt in keep:  # the exchanges still in flight (the overlapped runs' last), finished alike everywhere
        opt.state_dict()
    bps.shutdown()
    sys.exit(0)


if spec["phase"] == "dense":
    finish()
c = spec["compressed"]


def compressed():
    model = build_model()
    opt = bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), c["sync_every"], fragments=c["fragments"],
                     compression_params=c["compression_params"], delay=c["delay"])
    keep.append(opt)
    return model, opt


model, opt = compressed()
if not resumed:
    train(model, opt, 0, c["steps"])
    parameters(model, "straight")
    names = [name for name, _ in model.named_parameters()]
    copies = [copy for fragment in opt.fragments for copy in fragment.copies]
    saved.update({f"global/{name}": copy.numpy().copy() for name, copy in zip(names, copies)})
model, opt = compressed()
path = os.path.join(out, f"ckpt{rank}.pt")


def checkpoint(step):
    if step == c["stop_at"]:  # DiLoCo's state first: it waits for the exchange in flight
        torch.save({"model": model.state_dict(), "diloco": opt.state_dict(), "bps_gc": bps.state_dict()}, path)
        parameters(model, "first")


if resumed:
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["diloco"])
    bps.load_state_dict(ckpt["bps_gc"])
    bps.barrier()  # every rank's state (the servers' part too) is back before any push
    train(model, opt, c["stop_at"], c["steps"])
    parameters(model, "resumed")
else:
    train(model, opt, 0, c["steps"], checkpoint)
    parameters(model, "first_end")
finish()
