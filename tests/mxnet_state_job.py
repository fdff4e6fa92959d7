"""Worker side of tests/test_mxnet_state.py: a tiny gluon model trained with DistributedTrainer
that checkpoints (save_parameters + save_states on every rank) and resumes.

``python tests/mxnet_state_job.py SPEC.json OUT_DIR``: trains ``steps`` steps; with ``stop_at``
it saves after that step and exits; a run that finds OUT_DIR/ckpt<rank>.params resumes from it.
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
net = make_net(7)
params = net.collect_params()
trainer = bps.DistributedTrainer(params, "sgd", dict(spec["optimizer"]),
                                 compression_params=spec["compression"])
stem = os.path.join(out_dir, f"ckpt{rank}")
start = 0
if os.path.exists(stem + ".params"):
    net.load_parameters(stem + ".params")
    trainer.load_states(stem + ".states")
    start = json.load(open(stem + ".json"))["step"] + 1
    print(f"rank {rank} resumed at step {start}", flush=True)
loss_fn = gluon.loss.L2Loss()
for step in range(start, spec["steps"]):
    trainer.set_learning_rate(spec["lrs"][step])
    x, y = batch(rank, step, spec["batch"])
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(spec["batch"])
    if step == spec.get("stop_at") and start == 0:
        net.save_parameters(stem + ".params")
        trainer.save_states(stem + ".states")
        json.dump({"step": step}, open(stem + ".json", "w"))
        break
else:
    np.savez(os.path.join(out_dir, f"final{rank}.npz"),
             **{name: p.data().asnumpy() for name, p in params.items()})
mx.nd.waitall()
bps.shutdown()
