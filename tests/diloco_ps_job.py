"""bps_gc.torch.DiLoCo on the parameter server (under ``bpslaunch --local``), the outer step on
the workers and on the servers: ``python diloco_ps_job.py SPEC.json OUT``.

Phase "dense" (2 hosts x 2 local ranks) first runs spec "compressed"'s settings (top-k + EF, two
staggered fragments, tau = 1) in lockstep: each worker a replica, per mode as is and with the
warm phase (``<mode>/<stage>[/warm]/``), and each host one (replicate="hosts":
``hosts/<stage>/<mode>/``); at ``stop_at``, each with a fragment's exchange in flight, it saves
the models, the DiLoCos' states and bps_gc.torch.state_dict() to OUT/ckpt<rank>.pt ("first"),
trains on ("first_end"), then runs them again never saved ("straight"). Phase "resumed" (a new
launch of the same shape) makes those runs again, loads the checkpoint and trains the rest
("resumed"). Each run's end saves its parameters, its global copies ("global/") and, with the
outer step on the servers, the global copy pulled from the servers and the worker's own
(``pulled``). checkpoint_runs() says more.

Phase "dense" and "all" (3 workers) then train each case of the spec (sync_every, fragments,
steps, delay) on each rank's own batches, dense, once per outer step mode: "workers" (named)
and "servers" (DiLoCo's default on the parameter server: the identity codec), saved as
``<mode>/<case>/<name>`` with the mode DiLoCo took (``outer_step``). Phase "dense" then runs spec "host_cases" again with each host one
replica (DDP on the host's group, each local rank half the host's batch), saved as
``hosts/<mode>/<case>/`` with the global copies and each run's bytes pushed ("pushed_wire"), and
the first of them, stopped at stop_at with an exchange in flight, resumed in new objects from
its model's and DiLoCo's states in the same launch ("hosts/resumed"). Phase "all" first tries a
DiLoCo with a process group (refused: "refused"), and ends with a DiLoCo on the servers whose
rank 1 starts from other parameters (refused there: "differs"), the mode the default takes for
an outer AdamW ("adamw/outer_step"), and thc 4-bit at H = 4 for 8 inner steps (the default: the
workers'), its bytes pushed ("thc/pushed_wire") and the dtypes of its phase tensors
("thc/phase_dtypes"). Each rank saves OUT/<phase><rank>.npz."""
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import bps_gc.torch as bps  # noqa: E402
from bps_gc import core  # noqa: E402
from npz_files import savez  # noqa: E402
from test_diloco import batch, build_model  # noqa: E402

# the dense runs' outer_step: the workers' named, the servers' DiLoCo's default on the parameter
# server (dense pseudo-gradients through the identity codec); each run saves what it resolved to
MODES = {"workers": "workers", "servers": None}
spec, out = json.load(open(sys.argv[1])), sys.argv[2]
bps.init()
rank = bps.rank()
phase = spec["phase"]
saved = {}


def inner_step(model, opt, step):
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def parameters(model, label):
    saved.update({f"{label}/{name}": p.detach().numpy().copy() for name, p in model.named_parameters()})


def diloco(sync_every, fragments, delay, compression_params, outer_step, warm_steps=0, warm_every=None):
    model = build_model()
    opt = bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every, fragments=fragments,
                     delay=delay, compression_params=compression_params, outer_step=outer_step, warm_steps=warm_steps,
                     warm_every=warm_every)
    keep.append(opt)
    return model, opt


def pulled(opt, label):
    """With the outer step on the servers, after every exchange in flight (each DiLoCo's, so no
    push_pull runs): the global copy fetched from the servers ("<label>/pulled/<name>") and
    this worker's own, with the update of a fragment's exchange still in flight added, as the
    servers added it ("<label>/mine/<name>")."""
    for kept in keep:
        kept.wait()
    pending = {name: update for f in opt.fragments if f.pending is not None for name, update in f.pending.items()}
    for name, value in opt.global_parameters().items():
        saved[f"{label}/pulled/{name}"] = value.numpy().copy()
    for name, copy in opt.held_on_servers():
        saved[f"{label}/mine/{name}"] = (copy + pending[name] if name in pending else copy).numpy().copy()


def finish():
    savez(os.path.join(out, f"{phase}{rank}.npz"), **saved)
    for opt in keep:  # the exchanges still in flight (the overlapped runs' last), finished alike everywhere
        opt.wait()
    bps.shutdown()
    sys.exit(0)


def host_replica(sync_every, fragments, delay, codec, outer_step, warm_steps=0, warm_every=None):
    """(model, its DDP over the host's group, its DiLoCo with the host one replica)."""
    model = build_model()
    replica = torch.nn.parallel.DistributedDataParallel(model, process_group=bps.host_group())
    opt = bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every, fragments=fragments,
                     delay=delay, compression_params=codec, outer_step=outer_step, warm_steps=warm_steps,
                     warm_every=warm_every, replicate="hosts")
    keep.append(opt)
    return model, replica, opt


def host_case(case, mode):
    sync_every, fragments, _, delay, warm_steps, warm_every = spec["cases"][case]
    return host_replica(sync_every, fragments, delay, None, MODES[mode], warm_steps, warm_every)


def host_steps(replica, opt, steps):
    """The host's batch of each step, split over its ranks; DDP averages their gradients."""
    host, half = rank // bps.local_size(), 6 // bps.local_size()
    for step in steps:
        x, y = (t[bps.local_rank() * half:(bps.local_rank() + 1) * half] for t in batch(host, step))
        torch.nn.functional.mse_loss(replica(x), y).backward()
        opt.step()
        opt.zero_grad()


def result(model, opt, label):
    """A run's parameters, its global copies ("<label>/global/<name>") and, with the outer step
    on the servers, theirs (``pulled``)."""
    parameters(model, label)
    saved.update({f"{label}/global/{name}": copy.numpy().copy()
                  for f in opt.fragments for name, copy in zip(f.names, f.copies)})
    if opt.on_servers:
        pulled(opt, label)


def compressed_runs():
    """{label with {} for the stage: (model, one inner step, DiLoCo)} of spec "compressed"'s
    settings: each worker a replica, per mode as is and with the warm phase, then each host one;
    last, dense pseudo-gradients with DiLoCo's default outer step (the servers'), "dense/"."""
    c = spec["compressed"]
    settings = (c["sync_every"], c["fragments"], c["delay"], c["compression_params"])
    runs = {}
    for mode in MODES:
        for warm in ("", "/warm"):
            model, opt = diloco(*settings, mode, **(c["warm"] if warm else {}))
            runs[f"{mode}/{{}}{warm}"] = (model, lambda step, m=model, o=opt: inner_step(m, o, step), opt)
    for mode in MODES:
        model, replica, opt = host_replica(*settings, mode)
        runs[f"hosts/{{}}/{mode}"] = (model, lambda step, r=replica, o=opt: host_steps(r, o, [step]), opt)
    model, opt = diloco(*settings[:3], None, None)  # dense, the default: every tensor's state on the servers
    runs["dense/{}"] = (model, lambda step, m=model, o=opt: inner_step(m, o, step), opt)
    return runs


def checkpoint_runs():
    """compressed_runs() in lockstep. Phase "dense": at stop_at (each with an exchange in
    flight) the models', the DiLoCos' states and bps_gc.torch.state_dict() (each rank its
    codec state, the host replicas' its parts'; the servers' state of the keys it restores)
    saved to OUT/ckpt<rank>.pt ("first"), trained on ("first_end"); then the same runs, never
    saved ("straight"; made after the checkpoint, so not in it). Phase "resumed", a new launch
    of the same shape: loaded, the rest trained ("resumed")."""
    c = spec["compressed"]
    runs, path, start = compressed_runs(), os.path.join(out, f"ckpt{rank}.pt"), 0
    if phase == "resumed":
        ckpt = torch.load(path, weights_only=True)
        for label, (model, _, opt) in runs.items():
            model.load_state_dict(ckpt[label]["model"])
            opt.load_state_dict(ckpt[label]["diloco"])
        bps.load_state_dict(ckpt["bps_gc"])
        bps.barrier()  # every rank's state (the servers' part too) is back before any push
        start = c["stop_at"]
    for step in range(start, c["steps"]):
        for _, one_step, _ in runs.values():
            one_step(step)
        if phase == "dense" and step + 1 == c["stop_at"]:  # DiLoCo's states first: they wait for the exchanges
            state = {label: {"model": model.state_dict(), "diloco": opt.state_dict()}
                     for label, (model, _, opt) in runs.items()}
            torch.save({**state, "bps_gc": bps.state_dict()}, path)
            for label, (model, _, _) in runs.items():
                parameters(model, label.format("first"))
    for label, (model, _, opt) in runs.items():
        result(model, opt, label.format("resumed" if phase == "resumed" else "first_end"))
    if phase == "dense":
        for label, (model, one_step, opt) in compressed_runs().items():
            for step in range(c["steps"]):
                one_step(step)
            result(model, opt, label.format("straight"))


if phase == "all":  # a process group on the parameter server: refused, nothing declared
    model = build_model()
    try:
        bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), 4, replicate=object())  # a group
    except ValueError as e:
        saved["refused"] = np.array(str(e))
keep = []  # every DiLoCo made (a resumed job makes them all again, declaring the same names)
if phase in ("dense", "resumed"):  # first: the checkpoint holds these alone
    checkpoint_runs()
if phase == "resumed":
    finish()
for mode, outer_step in MODES.items():
    for case, (sync_every, fragments, steps, delay, warm_steps, warm_every) in spec["cases"].items():
        model, opt = diloco(sync_every, fragments, delay, None, outer_step, warm_steps, warm_every)
        saved[f"{mode}/{case}/outer_step"] = np.array(opt.outer_step)
        for step in range(steps):
            inner_step(model, opt, step)
        parameters(model, f"{mode}/{case}")
        # which parameters went uncompressed (below BYTEPS_MIN_COMPRESS_BYTES): outer step on the workers
        saved[f"{mode}/{case}/averaged"] = np.array(sorted(opt.exchange.averaged), dtype=str)
        if mode == "servers":
            pulled(opt, f"{mode}/{case}")
if phase == "dense" and bps.local_size() > 1:  # a host's local ranks as one replica (replicate="hosts")
    for mode in MODES:
        for case in spec["host_cases"]:
            for kept in keep:  # the bytes counted next are this run's alone
                kept.wait()
            model, replica, opt = host_case(case, mode)
            bps.metrics()
            host_steps(replica, opt, range(spec["cases"][case][2]))
            opt.wait()
            label = f"hosts/{mode}/{case}"
            saved[f"{label}/pushed_wire"] = np.array(bps.metrics().pushed_wire)
            saved[f"{label}/averaged"] = np.array(sorted(opt.exchange.averaged), dtype=str)
            saved[f"{label}/outer_step"] = np.array(opt.outer_step)
            result(model, opt, label)
    # resumed in this launch (dense: no codec state to carry): the first host case stopped at
    # stop_at, an exchange in flight, its model's and DiLoCo's states loaded into new ones
    case, stop = spec["host_cases"][0], spec["compressed"]["stop_at"]
    model, replica, opt = host_case(case, "workers")
    host_steps(replica, opt, range(stop))
    state = {"model": model.state_dict(), "diloco": opt.state_dict()}
    parameters(model, "hosts/stopped")
    model, replica, opt = host_case(case, "workers")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["diloco"])
    host_steps(replica, opt, range(stop, spec["cases"][case][2]))
    parameters(model, "hosts/resumed")
if phase == "dense":
    finish()
for opt in keep:  # phase "all"
    opt.wait()
model = build_model()  # rank 1 starts from other parameters: refused there ("differs")
if rank == 1:
    with torch.no_grad():
        model[0].weight[0, 0] += 1e-3
try:
    bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), 4)  # the default: the servers'
except ValueError as e:
    saved["differs"] = np.array(str(e))
# the default where the servers cannot take the outer step: an outer AdamW, thc's phases (below)
saved["adamw/outer_step"] = np.array(bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), 4,
                                                outer_optimizer=torch.optim.AdamW).outer_step)
model, opt = diloco(4, 1, 0, {"compressor": "thc", "bits": 4}, None)
saved["thc/outer_step"] = np.array(opt.outer_step)
bps.metrics()  # reset: only thc's phases count
for step in range(8):
    inner_step(model, opt, step)
opt.wait()
saved["thc/pushed_wire"] = np.array(bps.metrics().pushed_wire)
saved["thc/phase_dtypes"] = np.array(sorted({str(t.dtype) for name, t in core.communicator().tensors.items()
                                             if "|phase" in name}))
finish()
