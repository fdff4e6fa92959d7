"""Worker side of tests/test_mxnet_binding.py.

``python tests/mxnet_job.py train SPEC.json OUT_DIR`` (a worker process of a local cluster):
trains one small gluon network per codec configuration of the spec with
bps_gc.mxnet.DistributedTrainer and saves, per rank, every raw gradient (before
``trainer.step``) and every parameter after it; then the other binding calls
(broadcast from root 1, byteps_push_pull) on 2 workers.

``python tests/mxnet_job.py errors OUT.json`` (one process, no cluster): the error
cases and the NDArray <-> numpy access.
"""
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

import bps_gc.core
import bps_gc.mxnet as bps

IN, HIDDEN, OUT = 20, 16, 4


def make_net(seed):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(HIDDEN, activation="relu", in_units=IN), gluon.nn.Dense(OUT, in_units=HIDDEN))
    net.initialize(mx.init.Uniform(0.5))
    return net


def batch(rank, step, size):
    rng = np.random.default_rng(1000 * rank + step)
    return (nd.array(rng.standard_normal((size, IN)).astype(np.float32)),
            nd.array(rng.standard_normal((size, OUT)).astype(np.float32)))


def save(out, prefix, params):
    for name, p in params.items():
        out[f"{prefix}/{name}"] = p.data().asnumpy().copy()


def train(spec, out_dir):
    bps.init()
    rank, size = bps.rank(), bps.size()
    out, meta = {}, {"configs": []}
    loss_fn = gluon.loss.L2Loss()
    for j, config in enumerate(spec["configs"]):
        net = make_net(7)
        params = net.collect_params()
        trainer = bps.DistributedTrainer(params, "sgd", dict(spec["optimizer"]),
                                         compression_params=config or None, prefix=f"c{j}.")
        names = sorted(params.keys())
        save(out, f"{j}/init", params)
        bps_gc.core.metrics()  # reset: the counters of this configuration only
        for step, lr in enumerate(spec["lrs"]):
            trainer.set_learning_rate(lr)
            x, y = batch(rank, step, spec["batch"])
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            for name in names:
                out[f"{j}/grad/{step}/{name}"] = params[name].grad().asnumpy().copy()
            trainer.step(spec["batch"])
            save(out, f"{j}/param/{step}", params)
        m = bps_gc.core.metrics()
        tensors = bps_gc.core.worker().tensors
        meta["configs"].append({
            "names": names,
            "index": [tensors[f"c{j}.gradient_{i}"].index for i in range(len(names))],
            "metrics": {"pushed_raw": m.pushed_raw, "pushed_wire": m.pushed_wire,
                        "pulled_raw": m.pulled_raw, "pulled_wire": m.pulled_wire, "ratio": m.ratio}})

    if size > 1:
        extras(out, rank, loss_fn)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)
    json.dump(meta, open(os.path.join(out_dir, f"meta{rank}.json"), "w"))
    bps.shutdown()


def extras(out, rank, loss_fn):
    # broadcast from root 1: each rank starts from its own initial values
    net = make_net(100 + rank)
    save(out, "bcast/before", net.collect_params())
    bps.broadcast_parameters(net.collect_params(), root_rank=1)
    save(out, "bcast/after", net.collect_params())
    arrays = {"b": nd.array(np.full(5, rank + 1.0, np.float32)), "a": nd.arange(3) * (rank + 1)}
    bps.broadcast_parameters(arrays, root_rank=1)
    for name, value in arrays.items():
        out[f"bcast/dict/{name}"] = value.asnumpy()
    # the trainer's first-step broadcast from root 1 (lr 0: the step changes nothing else)
    net = make_net(200 + rank)
    save(out, "tbcast/before", net.collect_params())
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.0},
                                     root_rank=1, prefix="tbcast.")
    x, y = batch(rank, 0, 4)
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(4)
    save(out, "tbcast/after", net.collect_params())

    # byteps_push_pull in place, averaged and summed, dense and with byteps_* kwargs
    t = nd.array(np.arange(6, dtype=np.float32) * (rank + 1))
    bps.byteps_push_pull(t, name="pp.avg", is_average=True)
    out["pp/avg"] = t.asnumpy()
    t = nd.array(np.arange(6, dtype=np.float32) * (rank + 1))
    bps.byteps_push_pull(t, name="pp.sum", is_average=False)
    out["pp/sum"] = t.asnumpy()
    bps.byteps_declare_tensor("pp.onebit", byteps_compressor_type="onebit",
                              byteps_compressor_onebit_scaling="true")
    t = nd.ones((1000,)) * (rank + 1)
    bps.byteps_push_pull(t, name="pp.onebit", is_average=True)
    out["pp/onebit"] = t.asnumpy()


def errors(out_path):
    results = {}

    def catch(case, fn):
        try:
            fn()
            results[case] = None
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            results[case] = [type(e).__name__, str(e)]

    net = make_net(1)
    params = net.collect_params()
    catch("trainer before init", lambda: bps.DistributedTrainer(params, "sgd", {"learning_rate": 0.1}))
    catch("push_pull before init", lambda: bps.byteps_push_pull(nd.ones(3), name="x"))
    catch("broadcast before init", lambda: bps.broadcast_parameters(params))
    catch("rank before init", bps.rank)
    bps.init()
    opt = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4}

    def trainer_with(compression):
        return lambda: bps.DistributedTrainer(params, "sgd", opt, compression_params=compression)

    catch("bad compressor", trainer_with({"compressor": "zip"}))
    catch("bad k", trainer_with({"compressor": "topk", "k": -1}))
    catch("unknown key", trainer_with({"compresor": "topk"}))
    catch("momentum without optimizer momentum", lambda: bps.DistributedTrainer(
        params, "sgd", {"learning_rate": 0.1}, compression_params={"compressor": "onebit", "momentum": "nesterov"}))
    catch("momentum with optimizer momentum 0", lambda: bps.DistributedTrainer(
        params, "sgd", {"learning_rate": 0.1, "momentum": 0.0},
        compression_params={"compressor": "onebit", "momentum": "nesterov"}))
    catch("list of parameters", lambda: bps.DistributedTrainer(list(params.values()), "sgd", opt))
    # a correct one: the caller's optimizer_params stay as they were
    caller = dict(opt)
    trainer = bps.DistributedTrainer(params, "sgd", caller, compression_params={
        "compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov"}, prefix="ok.")
    results["caller optimizer_params"] = caller
    results["optimizer momentum, wd"] = [trainer.optimizer.momentum, trainer.optimizer.wd]

    # CPU NDArrays reach the core as views of their memory; others are copied and written back
    from bps_gc.mxnet import tensors
    with autograd.record():
        loss = net(nd.ones((2, IN))).sum()
    loss.backward()
    views = []
    for p in params.values():
        host = tensors.HostArray(p.grad())
        host.array[...] = 3.0
        views.append([host.copied, bool((p.grad().asnumpy() == 3.0).all())])
    results["grad views"] = views
    original = tensors._view
    tensors._view = lambda nd_, write: None
    t = nd.arange(4)
    host = tensors.HostArray(t)
    host.array += 1
    untouched = t.asnumpy().tolist()
    host.commit()
    results["copy fallback"] = [host.copied, untouched, t.asnumpy().tolist()]
    tensors._view = original

    # one process without BYTEPS_FORCE_DISTRIBUTED: the same steps as a plain gluon Trainer
    nets = [make_net(3), make_net(3)]
    trainers = [bps.DistributedTrainer(nets[0].collect_params(), "sgd", dict(opt), prefix="single."),
                gluon.Trainer(nets[1].collect_params(), "sgd", dict(opt), kvstore=None)]
    for step in range(3):
        x, y = batch(0, step, 8)
        for net_, trainer_ in zip(nets, trainers):
            with autograd.record():
                loss = gluon.loss.L2Loss()(net_(x), y)
            loss.backward()
            trainer_.step(8)
    results["single process max diff"] = max(
        float(np.abs(a.data().asnumpy() - b.data().asnumpy()).max())
        for a, b in zip(nets[0].collect_params().values(), nets[1].collect_params().values()))
    json.dump(results, open(out_path, "w"))
    bps.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(json.load(open(sys.argv[2])), sys.argv[3])
    elif sys.argv[1] == "errors":
        errors(sys.argv[2])
    else:
        sys.exit(f"unknown mode {sys.argv[1]!r}")
