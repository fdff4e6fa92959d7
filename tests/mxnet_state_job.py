"""Worker side of tests/test_mxnet_state.py: tiny gluon models trained with DistributedTrainer
(one per compression configuration of the spec, each its own trainer and tensor prefix) that
checkpoint (save_parameters + save_states on every rank) and resume.

``python tests/mxnet_state_job.py SPEC.json OUT_DIR``: trains ``steps`` steps; with ``stop_at``
it saves after that step and exits; a run that finds OUT_DIR/ckpt<rank>.json resumes from it.
The final parameters go to OUT_DIR/final<rank>.npz.
"""
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bps_gc.mxnet as bps  # noqa: E402
from mxnet_job import batch, make_net  # noqa: E402

spec_path, out_dir = sys.argv[1], sys.argv[2]
spec = json.load(open(spec_path))
bps.init()
rank = bps.rank()
models = []
for j, (compression, optimizer) in enumerate(spec["configs"]):
    net = make_net(7)
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", dict(optimizer, learning_rate=0.1),
                                     compression_params=compression, prefix=f"c{j}.")
    models.append((net, trainer, os.path.join(out_dir, f"ckpt{rank}-{j}")))
mark = os.path.join(out_dir, f"ckpt{rank}.json")
start = 0
if os.path.exists(mark):
    for net, trainer, stem in models:
        net.load_parameters(stem + ".params")
        trainer.load_states(stem + ".states")
    start = json.load(open(mark))["step"] + 1
    print(f"rank {rank} resumed at step {start}", flush=True)
loss_fn = gluon.loss.L2Loss()
for step in range(start, spec["steps"]):
    x, y = batch(rank, step, spec["batch"])
    for net, trainer, _ in models:
        trainer.set_learning_rate(spec["lrs"][step])
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(spec["batch"])
    if step == spec.get("stop_at") and start == 0:
        for net, trainer, stem in models:
            net.save_parameters(stem + ".params")
            trainer.save_states(stem + ".states")
        json.dump({"step": step}, open(mark, "w"))
        break
else:
    np.savez(os.path.join(out_dir, f"final{rank}.npz"),
             **{f"{j}/{name}": p.data().asnumpy() for j, (net, _, _) in enumerate(models)
                for name, p in net.collect_params().items()})
mx.nd.waitall()
bps.shutdown()
