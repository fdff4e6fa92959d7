"""bps_gc.torch.DiLoCo on the parameter server (under ``bpslaunch --local``), the outer step on
the workers and on the servers: ``python diloco_ps_job.py SPEC.json OUT``.

Phase "dense" and "all": each case of the spec (sync_every, fragments, steps, delay) trains the
small MLP with inner SGD on each rank's own batches, once per outer step mode: "workers" (dense
pseudo-gradients) and "servers" (every element sent exactly: threshold 0), saved as
``<mode>/<case>/<name>``. Phase "dense" with local ranks then runs spec "host_cases" again with each
host one replica (replicate="hosts": DDP on the host's group, each local rank half the host's
batch), saved as ``hosts/<mode>/<case>/`` with the global copies and each run's bytes pushed
("pushed_wire"), and the first of them, stopped at spec "compressed"'s stop_at with an exchange in
flight, resumed in new objects from its model's and DiLoCo's states ("hosts/resumed"). Before
all that, phase "dense" with local ranks runs the compressed settings with each host one replica
and saves them mid-window to OUT/hostckpt<rank>.pt, which phase "hosts_resumed" (a new launch of
the same shape) resumes (host_checkpoint_runs). Phase "all" then runs the compressed settings ("compressed": top-k +
EF, two staggered fragments, tau = 1) once per mode, twice: "straight" (with its global copies,
"global"), and "first", the two modes' runs in lockstep, which at ``stop_at`` save the model,
DiLoCo's state and bps_gc.torch.state_dict() to OUT/ckpt<rank>.pt (each with a fragment's
exchange in flight) and train on ("first_end"); first it tries a DiLoCo with a process group
(refused: "refused"). Phase "resumed": the same objects made in the same order (so the same
names are declared), the checkpoint loaded, the rest trained ("resumed"). Phase "all" ends
with a DiLoCo on the servers whose rank 1 starts from other parameters (refused there:
"differs"), and thc 4-bit at H = 4 for 8 inner steps, its bytes pushed ("thc/pushed_wire") and the dtypes
of its phase tensors ("thc/phase_dtypes"). With the outer step on the servers, each run's end
also saves the global copy pulled from the servers and the worker's own (``pulled``). Each rank
saves OUT/<phase><rank>.npz. The compressed settings run twice per mode: as they are, and with
their "warm" phase (DiLoCo's warm_steps, warm_every; saved under ``<mode>/<label>/warm/``),
whose stop falls inside the warm phase with its exchange in flight."""
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import bps_gc.torch as bps  # noqa: E402
from bps_gc import core  # noqa: E402
from test_diloco import batch, build_model  # noqa: E402

MODES = {"workers": None, "servers": {"compressor": "threshold", "threshold": 0.0}}
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


def diloco(sync_every, fragments, delay, compression_params, mode, warm_steps=0, warm_every=None):
    model = build_model()
    opt = bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every, fragments=fragments,
                     delay=delay, compression_params=compression_params, outer_step=mode, warm_steps=warm_steps,
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
    np.savez(os.path.join(out, f"{phase}{rank}.npz"), **saved)
    for opt in keep:  # the exchanges still in flight (the overlapped runs' last), finished alike everywhere
        opt.wait()
    bps.shutdown()
    sys.exit(0)


def host_replica(sync_every, fragments, delay, codec, mode, warm_steps=0, warm_every=None):
    """(model, its DDP over the host's group, its DiLoCo with the host one replica)."""
    model = build_model()
    replica = torch.nn.parallel.DistributedDataParallel(model, process_group=bps.host_group())
    opt = bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every, fragments=fragments,
                     delay=delay, compression_params=codec, outer_step=mode, warm_steps=warm_steps,
                     warm_every=warm_every, replicate="hosts")
    keep.append(opt)
    return model, replica, opt


def host_case(case, mode):
    sync_every, fragments, _, delay, warm_steps, warm_every = spec["cases"][case]
    return host_replica(sync_every, fragments, delay, MODES[mode], mode, warm_steps, warm_every)


def host_steps(replica, opt, steps):
    """The host's batch of each step, split over its ranks; DDP averages their gradients."""
    host, half = rank // bps.local_size(), 6 // bps.local_size()
    for step in steps:
        x, y = (t[bps.local_rank() * half:(bps.local_rank() + 1) * half] for t in batch(host, step))
        torch.nn.functional.mse_loss(replica(x), y).backward()
        opt.step()
        opt.zero_grad()


def host_result(model, opt, label):
    """A host replica's parameters, global copies ("global/") and, on the servers, theirs."""
    parameters(model, label)
    saved.update({f"{label}/global/{name}": copy.numpy().copy()
                  for f in opt.fragments for name, copy in zip(f.names, f.copies)})
    if opt.on_servers:
        pulled(opt, label)


def host_checkpoint_runs():
    """Spec "compressed"'s settings (top-k + EF) with each host one replica, both modes in
    lockstep. Phase "dense": at stop_at (an exchange in flight) the model's, DiLoCo's and
    bps_gc.torch.state_dict() (the parts' residuals, host 0's ranks the servers' state of their
    parts) saved to OUT/hostckpt<rank>.pt, trained on ("hosts/saved/<mode>"), then the same run
    never saved ("hosts/straight/<mode>", made after the checkpoint: not in it). Phase
    "hosts_resumed": loaded in a new launch, the rest trained ("hosts/resumed/<mode>")."""
    c = spec["compressed"]
    settings = (c["sync_every"], c["fragments"], c["delay"], c["compression_params"])
    runs = {mode: host_replica(*settings, mode) for mode in MODES}
    path, start = os.path.join(out, f"hostckpt{rank}.pt"), 0
    if phase == "hosts_resumed":
        ckpt = torch.load(path, weights_only=True)
        for mode, (model, _, opt) in runs.items():
            model.load_state_dict(ckpt[mode]["model"])
            opt.load_state_dict(ckpt[mode]["diloco"])
        bps.load_state_dict(ckpt["bps_gc"])
        bps.barrier()  # every rank's state (the servers' part too) is back before any push
        start = c["stop_at"]
    for step in range(start, c["steps"]):
        for _, replica, opt in runs.values():
            host_steps(replica, opt, [step])
        if phase == "dense" and step + 1 == c["stop_at"]:  # DiLoCo's states first: they wait for the exchanges
            state = {mode: {"model": model.state_dict(), "diloco": opt.state_dict()}
                     for mode, (model, _, opt) in runs.items()}
            torch.save({**state, "bps_gc": bps.state_dict()}, path)
    for mode, (model, _, opt) in runs.items():
        host_result(model, opt, f"hosts/{'resumed' if phase == 'hosts_resumed' else 'saved'}/{mode}")
    if phase == "dense":
        for mode in MODES:
            model, replica, opt = host_replica(*settings, mode)
            host_steps(replica, opt, range(c["steps"]))
            host_result(model, opt, f"hosts/straight/{mode}")


if phase == "all":  # a process group on the parameter server: refused, nothing declared
    model = build_model()
    try:
        bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), 4, replicate=object())  # a group
    except ValueError as e:
        saved["refused"] = np.array(str(e))
keep = []  # every DiLoCo made (a resumed job makes them all again, declaring the same names)
if phase in ("dense", "hosts_resumed") and bps.local_size() > 1:  # first: the checkpoint holds these alone
    host_checkpoint_runs()
if phase == "hosts_resumed":
    finish()
for mode, codec in MODES.items():
    for case, (sync_every, fragments, steps, delay, warm_steps, warm_every) in spec["cases"].items():
        model, opt = diloco(sync_every, fragments, delay, codec, mode, warm_steps, warm_every)
        if phase != "resumed":
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
            host_result(model, opt, label)
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
c = spec["compressed"]
settings = (c["sync_every"], c["fragments"], c["delay"], c["compression_params"])
# each mode once as is and once with spec "warm"'s warm phase ("<mode>/<label>/warm/<name>")
RUNS = [(mode, warm) for mode in MODES for warm in ("", "warm/")]


def warm_run(mode, warm):
    return diloco(*settings, mode, **(c["warm"] if warm else {}))


for mode, warm in RUNS:
    model, opt = warm_run(mode, warm)
    if phase != "resumed":
        for step in range(c["steps"]):
            inner_step(model, opt, step)
        parameters(model, f"{mode}/straight/{warm}".rstrip("/"))
        names = [name for name, _ in model.named_parameters()]
        copies = [copy for fragment in opt.fragments for copy in fragment.copies]
        if not warm:
            saved.update({f"{mode}/global/{name}": copy.numpy().copy() for name, copy in zip(names, copies)})
        if mode == "servers":
            pulled(opt, f"{mode}/straight/{warm}".rstrip("/"))
runs = {(mode, warm): warm_run(mode, warm) for mode, warm in RUNS}  # trained in lockstep: one checkpoint
path = os.path.join(out, f"ckpt{rank}.pt")
start = 0
if phase == "resumed":
    ckpt = torch.load(path, weights_only=True)
    for (mode, warm), (model, opt) in runs.items():
        model.load_state_dict(ckpt[mode + warm]["model"])
        opt.load_state_dict(ckpt[mode + warm]["diloco"])
    bps.load_state_dict(ckpt["bps_gc"])
    bps.barrier()  # every rank's state (the servers' part too) is back before any push
    start = c["stop_at"]
for step in range(start, c["steps"]):
    for model, opt in runs.values():
        inner_step(model, opt, step)
    if phase == "all" and step + 1 == c["stop_at"]:  # DiLoCo's states first: they wait for the exchanges
        state = {mode + warm: {"model": model.state_dict(), "diloco": opt.state_dict()}
                 for (mode, warm), (model, opt) in runs.items()}
        torch.save({**state, "bps_gc": bps.state_dict()}, path)
        for (mode, warm), (model, _) in runs.items():
            parameters(model, f"{mode}/first/{warm}".rstrip("/"))
for (mode, warm), (model, opt) in runs.items():
    label = f"{mode}/{'resumed' if phase == 'resumed' else 'first_end'}/{warm}".rstrip("/")
    parameters(model, label)
    if mode == "servers":  # the servers' global copies, resumed from the checkpoint's and trained on
        pulled(opt, label)
if phase == "all":  # declared last: the checkpoint and the resumed phase never see it
    for opt in keep:
        opt.wait()
    model = build_model()  # rank 1 starts from other parameters: refused there ("differs")
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] += 1e-3
    try:
        bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), 4, compression_params=MODES["servers"],
                   outer_step="servers")
    except ValueError as e:
        saved["differs"] = np.array(str(e))
    model, opt = diloco(4, 1, 0, {"compressor": "thc", "bits": 4}, "workers")
    bps.metrics()  # reset: only thc's phases count
    for step in range(8):
        inner_step(model, opt, step)
    opt.wait()
    saved["thc/pushed_wire"] = np.array(bps.metrics().pushed_wire)
    saved["thc/phase_dtypes"] = np.array(sorted({str(t.dtype) for name, t in core.communicator().tensors.items()
                                                 if "|phase" in name}))
finish()
