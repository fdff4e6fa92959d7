"""FSDP2 on a (2 replicas, 2 shards) gloo mesh under torchrun (4 ranks; spec "mesh" [2, 3]: 6
ranks): ``python fsdp_job.py SPEC.json OUT``. A small MLP trains ``steps`` SGD steps on each
rank's own batches (``micro_batches`` per step, gradients synced on the last). spec "mode":

* "native": HSDP (fully_shard on the 2-D mesh); then register_fsdp_hooks, which must refuse it,
  refuse a model sharded on mesh["shard"] handed mesh["shard"] as its replicate group, and
  refuse TernGrad on a model whose reduce dtype is float64;
* "hooked": fully_shard on mesh["shard"] and bps_gc.torch.register_fsdp_hooks on
  mesh["replicate"] with spec "compression_params", recording every hook call's reduce-scatter
  output before and after (widened to float32); with spec "shard_compression_params", the
  in-host reduce-scatter compressed too, each call's input, output and seconds recorded
  ("rs<i>/", "rs_seconds") and metrics()' bytes of the run saved (spec "record_rs": the same of
  FSDP2's own reduce-scatter); spec "widths": the MLP's; spec "dense_steps": the hooks';
* "resume" (init_process_group, then bps_gc.torch.init() adopting that group, as FSDP2 scripts
  do), one model per spec "runs" entry (its name: its compression_params; spec "dense_steps"
  {run: the hooks' dense_steps}; spec "diloco" {run: compression_params}: a DiLoCo over the
  model sharded without hooks, H = 2, its own state in OUT/diloco<rank>.pt), spec "phase": "first" trains ``stop_at`` steps, saves the
  models and optimizers (torch.distributed.checkpoint, OUT/dcp) and bps_gc.torch.state_dict() (OUT/bps<rank>.pt),
  then trains on to ``steps``; "resumed" builds afresh, loads them and trains the rest, then
  trains straight runs (no checkpoint) in the same process, and hands their DTensor parameters
  to DistributedOptimizer and to comm_hook, which must refuse them;
* "diloco": fully_shard on mesh["shard"], bps_gc.torch.DiLoCo across mesh["replicate"] (below);
* "lm": the LM's GPT (lm_hsdp_case.py) sharded as the yardstick shards it (example/pytorch/lm/hsdp.py)
  the spec "how" way: "native" HSDP or the dense "hooks"; its full parameters after its steps;
* "fault" (under bps_gc.torch.init()): trains until told to stop, writing OUT/pid<rank> once
  running; rank spec "victim" at step 3 does spec "fault": "kill" (SIGKILL itself), "exit"
  (sys.exit(0)) or "raise".

"parts": several such launches in one, spec "parts" {name: spec of "native" or "hooked"}, each
part's arrays prefixed "<name>/" (every model seeded and fed as in a launch of its own); a part of
mode "resume" (phase "first": run first, so that bps_gc names its hooks' state as a launch of
its own does) runs between bps.init() and bps.shutdown() on the job's group, its arrays saved
apart, as its own launch saves them.

"native" and "hooked" also train one more model per spec "policies" entry (POLICIES: fully_shard's
mixed precision or CPU offload, or float64 parameters), its arrays prefixed "<policy>/" (a
codec that cannot take its reduce dtype: register_fsdp_hooks' refusal, "<policy>/refused").
Spec "plain": false: no plain model, the policies' alone. Each rank saves its full
parameters and its local shards, prefixed by the run's name. "hooked" then trains a wider MLP
(WIDE) with each spec "bytes" codec (name: compression_params, null: dense) and saves its
bytes per step and codec memory (fsdp_bytes.py), prefixed "bytes/<name>/"; and with each spec
"bytes_device" codec on device chains (BPS_GC_DEVICE_CODECS=torch: a CUDA shard's codecs, on
the CPU), prefixed "bytes/<name> device/"."""
import functools
import json
import os
import sys
from unittest.mock import patch  # patch.dict: an environment variable set for a block, then put back

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import bps_gc.torch as bps  # noqa: E402
from fsdp_bytes import array_bytes, bytes_and_memory  # noqa: E402
from fsdp_recording import record_calls, record_reduce_scatters  # noqa: E402
from job_faults import fault_at  # noqa: E402
from npz_files import NpzWriter, savez  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
mode = spec["mode"]
if mode != "fault":
    dist.init_process_group("gloo")


def init_bps():
    bps.init()  # the collective communicator: bps.state_dict(), the heartbeat (resume: on the group above)
    assert (bps.rank(), bps.size()) == (dist.get_rank(), 4), (bps.rank(), bps.size())


if mode in ("resume", "fault"):
    init_bps()
rank = dist.get_rank()
torch.set_num_threads(1)
# spec "mesh": (replicas, shards), (2, 2) unless given; the job's ranks are their product
mesh = init_device_mesh("cpu", tuple(spec.get("mesh", (2, 2))), mesh_dim_names=("replicate", "shard"))
POLICIES = {  # fully_shard's options of the extra models (spec "policies")
    "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
    "bf16r": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)},
    "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},  # pinned memory needs an accelerator
    "fp64r": {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float64)},
    "f16r": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)},
    "fp64": {},  # float64 parameters (PARAM_DTYPES), reduced in float64
}
PARAM_DTYPES = {"fp64": torch.float64}  # the policies whose model is built in another dtype than float32


WIDE = (128, 256, 256, 128)  # the bytes' MLP: weight shards of 16,384 to 32,768 elements


def build(hooked=True, hooks=True, policy=None, compression_params=spec.get("compression_params"),
          widths=(16, 32, 32, 8), shard_compression_params=None, dense_steps=0, momentum=0.0):
    """The MLP of ``widths`` sharded on mesh["shard"] (``hooked``) or on the whole mesh (native
    HSDP) with POLICIES[``policy``], its hooks (the exchange; none unless ``hooked`` and
    ``hooks``) and its optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(widths[0], widths[1]), torch.nn.ReLU(),
                                torch.nn.Linear(widths[1], widths[2]), torch.nn.ReLU(),
                                torch.nn.Linear(widths[2], widths[3])).to(PARAM_DTYPES.get(policy, torch.float32))
    shard_mesh = mesh["shard"] if hooked else mesh
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=shard_mesh, **POLICIES.get(policy, {}))
    fully_shard(model, mesh=shard_mesh, **POLICIES.get(policy, {}))
    exchange = bps.register_fsdp_hooks(model, mesh["replicate"], compression_params, dense_steps=dense_steps,
                                       shard_compression_params=shard_compression_params) if hooked and hooks else None
    return model, exchange, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


def train(model, opt, steps, on_step=None, micro_batches=spec.get("micro_batches", 1)):
    """``micro_batches`` a step, all but the last under set_requires_gradient_sync(False)."""
    for step in steps:
        if on_step:
            on_step(step)
        for micro in range(micro_batches):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
            x = torch.randn(4, model[0].in_features, generator=g).to(model[0].weight.dtype)  # float64 parameters
            y = torch.randn(4, model[4].out_features, generator=g)
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            torch.nn.functional.mse_loss(model(x).float(), y).backward()  # bf16 parameters: bf16 output
        opt.step()
        opt.zero_grad()


def parameters(model, prefix=""):
    full = {f"{prefix}full/{name}": p.full_tensor().detach().numpy() for name, p in model.named_parameters()}
    return {**full, **{f"{prefix}local/{name}": p.to_local().detach().numpy() for name, p in model.named_parameters()}}


def with_diloco(params, sync_every=2):
    """(the MLP sharded on mesh["shard"] without hooks, None, bps_gc.torch.DiLoCo over its SGD
    with momentum across mesh["replicate"], ``params`` its codec)."""
    model, _, opt = build(hooks=False, momentum=0.9)
    return model, None, bps.DiLoCo(model, opt, sync_every, replicate=mesh["replicate"].get_group(),
                                   compression_params=params)


def checkpoints(runs, ckpt):
    """[(checkpoint_id, process group, {run: (model, exchange, optimizer)})] that
    torch.distributed.checkpoint saves and loads: the hooks' runs over every rank (the replicas
    hold the same model); each DiLoCo run per replica, over its shard group, whose ranks hold
    that replica's own model (between syncs the replicas differ, and one checkpoint over every
    rank would keep one replica's shards for both)."""
    hooked = {run: r for run, r in runs.items() if not isinstance(r[2], bps.DiLoCo)}
    replica = mesh.get_coordinate()[0]
    return [(ckpt, None, hooked)] + [(f"{ckpt}_{run}_replica{replica}", mesh["shard"].get_group(), {run: r})
                                    for run, r in runs.items() if run not in hooked]


def inner(opt):
    """The torch optimizer torch.distributed.checkpoint saves: a DiLoCo's inner one."""
    return opt.inner if isinstance(opt, bps.DiLoCo) else opt


def resume(spec):
    """Each run's arrays prefixed "<run>/": the models, one per spec "runs" entry, are trained,
    saved and loaded together, as one script's several models would be; SGD with momentum, whose
    state the checkpoint carries too."""
    steps, stop_at, ckpt = spec["steps"], spec["stop_at"], os.path.join(out, "dcp")
    # run -> its shard_compression_params, its dense_steps
    in_host, dense = spec.get("in_host", {}), spec.get("dense_steps", {})
    runs = {run: build(compression_params=params, shard_compression_params=in_host.get(run),
                       dense_steps=dense.get(run, 0), momentum=0.9) for run, params in spec["runs"].items()}
    runs.update({run: with_diloco(params) for run, params in spec.get("diloco", {}).items()})

    def train_all(steps):
        for model, _, opt in runs.values():
            train(model, opt, steps)
    if spec["phase"] == "first":
        train_all(range(stop_at))
        for where, group, some in checkpoints(runs, ckpt):
            dcp.save({run: dict(zip(("model", "optim"), get_state_dict(model, inner(opt))))
                      for run, (model, _, opt) in some.items()}, checkpoint_id=where, process_group=group)
        bps.save_checkpoint(bps.state_dict(), os.path.join(out, f"bps{rank}.pt"))
        torch.save({run: {k: v for k, v in opt.state_dict().items() if k != "inner"}  # DiLoCo's own
                    for run, (_, _, opt) in runs.items() if isinstance(opt, bps.DiLoCo)}, os.path.join(out, f"diloco{rank}.pt"))
        train_all(range(stop_at, steps))
        return {k: v for run, (model, _, _) in runs.items() for k, v in parameters(model, f"{run}/first/").items()}
    saved = {run: dict(zip(("model", "optim"), get_state_dict(model, inner(opt)))) for run, (model, _, opt) in runs.items()}
    for where, group, some in checkpoints(runs, ckpt):
        dcp.load({run: saved[run] for run in some}, checkpoint_id=where, process_group=group)
    for run, (model, _, opt) in runs.items():
        set_state_dict(model, inner(opt), model_state_dict=saved[run]["model"], optim_state_dict=saved[run]["optim"])
    bps.load_state_dict(bps.load_checkpoint(os.path.join(out, f"bps{rank}.pt")))
    own = torch.load(os.path.join(out, f"diloco{rank}.pt"), weights_only=True)
    for run, (_, _, opt) in runs.items():
        if isinstance(opt, bps.DiLoCo):
            opt.load_state_dict({**own[run], "inner": opt.inner.state_dict()})
    train_all(range(stop_at, steps))
    result = {k: v for run, (model, _, _) in runs.items() for k, v in parameters(model, f"{run}/resumed/").items()}
    for run, params in spec["runs"].items():
        straight, _, opt = build(compression_params=params, shard_compression_params=in_host.get(run),
                                 dense_steps=dense.get(run, 0), momentum=0.9)
        train(straight, opt, range(steps))
        result.update(parameters(straight, f"{run}/straight/"))
    for run, params in spec.get("diloco", {}).items():
        straight, _, opt = with_diloco(params)
        train(straight, opt, range(steps))
        result.update(parameters(straight, f"{run}/straight/"))
    # a sharded model's DTensors handed to DistributedOptimizer and to the DDP hook: refused, naming the hooks
    refusals = []
    for refused in (lambda: bps.DistributedOptimizer(torch.optim.SGD(straight.parameters(), lr=0.1),
                                                     named_parameters=straight.named_parameters()),
                    lambda: bps.comm_hook(spec["runs"]["topk"], named_parameters=straight.named_parameters()),
                    lambda: bps.comm_hook(None, optimizer=opt)):
        try:
            refused()
            refusals.append("")
        except TypeError as e:
            refusals.append(str(e))
    return {**result, "refusals": np.array(refusals)}


def fault():
    model, _, opt = build()
    train(model, opt, range(10**6), lambda step: fault_at(step, 3, rank, spec, out))


def diloco(part, head=""):
    """A "diloco" spec: the MLP sharded on mesh["shard"] without hooks, bps_gc.torch.DiLoCo
    across mesh["replicate"] (spec "sync_every", "compression_params"), its full parameters after
    every step ("<head>full/<step>/<name>"); with spec "refusals", DiLoCo's of a sharded model: no
    replicate group, mesh["shard"]'s (its ranks hold different shards), a model on the 2-D mesh."""
    model, _, inner = build(hooks=False)
    opt = bps.DiLoCo(model, inner, part["sync_every"], replicate=mesh["replicate"].get_group(),
                     compression_params=part.get("compression_params"))
    arrays = {}
    for step in range(part["steps"]):
        train(model, opt, [step])
        arrays.update({f"{head}full/{step}/{name}": p.full_tensor().detach().numpy()
                       for name, p in model.named_parameters()})
    refusals = []
    for sharded, replicate in ((build(hooks=False)[0], None), (build(hooks=False)[0], mesh["shard"].get_group()),
                               (build(hooked=False)[0], mesh["replicate"].get_group())) if part.get("refusals") else ():
        try:
            bps.DiLoCo(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), 2, replicate=replicate)
            refusals.append("")
        except ValueError as e:
            refusals.append(str(e))
    return arrays, refusals


def lm(part, head=""):
    """An "lm" spec: lm_hsdp_case's GPT, its full parameters after lm_hsdp_case.STEPS steps."""
    import lm_hsdp_case
    from hsdp import shard_gpt
    net = lm_hsdp_case.model()
    shard_gpt(net, mesh, part["how"])
    return {f"{head}full/{name}": p for name, p in lm_hsdp_case.train(net, rank).items()}, []


def native_or_hooked(part, head=""):
    """A "native" or "hooked" spec's runs: its arrays (names prefixed ``head``) and refusals."""
    arrays, hooked, micro_batches = {}, part["mode"] == "hooked", part.get("micro_batches", 1)
    # the plain model (unless spec "plain" is false), then one per policy
    for policy in ([None] if part.get("plain", True) else []) + part.get("policies", []):
        calls, prefix, in_host, rs_calls = [], head + ("" if policy is None else f"{policy}/"), None, []
        try:
            model, exchange, opt = build(hooked=hooked, policy=policy,
                                         compression_params=part.get("compression_params"),
                                         shard_compression_params=part.get("shard_compression_params"),
                                         widths=tuple(part.get("widths", (16, 32, 32, 8))),
                                         dense_steps=part.get("dense_steps", 0))
        except TypeError as e:  # a codec that cannot take the policy's reduce dtype: its refusal kept
            arrays[f"{prefix}refused"] = np.array(str(e))
            continue
        if exchange is not None:
            record_calls(model, calls)
            if part.get("shard_compression_params") is not None or part.get("record_rs"):
                record_reduce_scatters(model, rs_calls)
                bps.metrics()  # from here: this run's bytes
        train(model, opt, range(part["steps"]), micro_batches=micro_batches)
        if rs_calls:
            counted = bps.metrics()
            arrays.update({f"{prefix}rs{i}/{k}": v for i, c in enumerate(rs_calls)
                           for k, v in zip(("in", "out"), c[1:])})
            arrays.update({f"{prefix}rs_calls": np.array([c[0] for c in rs_calls]),
                           f"{prefix}rs_seconds": np.array([c[3:] for c in rs_calls]),
                           **{f"{prefix}bytes/{k}": getattr(counted, k) for k in (
                               "in_host_pushed_raw", "in_host_pushed_wire", "in_host_pulled_wire", "pushed_wire")}})
            in_host = getattr(exchange, "in_host", None)  # its saved codec state, and this rank's shard
            arrays.update({f"{prefix}bytes/in_host_state": 0 if in_host is None else
                           array_bytes(in_host.hook.codec_state().state_dict().values()),
                           f"{prefix}bytes/shard": sum(p.to_local().numel() * 4 for p in model.parameters())})
        arrays.update({**parameters(model, prefix), **{f"{prefix}call{i}/in": c[1] for i, c in enumerate(calls)},
                       **{f"{prefix}call{i}/out": c[2] for i, c in enumerate(calls)},
                       f"{prefix}calls": np.array([c[0] for c in calls])})
        if policy is None:
            plain = model
    # a wider model per codec: bytes and memory, on numpy chains, then (a CUDA shard's) on device chains
    for label, params, chains in [*((name, params, None) for name, params in part.get("bytes", {}).items()),
                                  *((f"{name} device", params, "torch")
                                    for name, params in part.get("bytes_device", {}).items())]:
        # the setting is read when the exchange first sees the shards, and put back after
        with patch.dict(os.environ, {"BPS_GC_DEVICE_CODECS": chains} if chains else {}):
            model, exchange, opt = build(compression_params=params, widths=WIDE)
            steps = functools.partial(train, model, opt, micro_batches=micro_batches)
            counted = bytes_and_memory(model, exchange, steps, part["steps"])
        arrays.update({f"{head}bytes/{label}/{k}": v for k, v in counted.items()})
    refusals = []
    if not hooked:  # sharded on the 2-D mesh; a replicate group that is not; a codec that cannot take
        # the reduce dtype (float64): each refused in one line
        for sharded, replicate, params in ((plain, mesh["replicate"], None),
                                           (build(hooks=False)[0], mesh["shard"], None),
                                           (build(hooks=False, policy="fp64r")[0], mesh["replicate"],
                                            {"compressor": "terngrad"}),
                                           (build(hooks=False, policy="fp64r")[0], mesh["replicate"],
                                            {"shard_compression_params": {"compressor": "terngrad"}})):
            try:
                in_host = (params or {}).pop("shard_compression_params", None)
                bps.register_fsdp_hooks(sharded, replicate, params or None, shard_compression_params=in_host)
                refusals.append("")
            except (TypeError, ValueError) as e:
                refusals.append(str(e))
    return arrays, refusals


def resume_and_save(spec):
    savez(os.path.join(out, f"{spec['phase']}{rank}.npz"), **resume(spec))
    bps.shutdown()
    dist.barrier()  # the adopted group is still the script's after bps_gc's shutdown


if mode == "fault":
    fault()
elif mode == "resume":
    resume_and_save(spec)
    dist.destroy_process_group()
else:
    # each part's arrays written as it ends: those before the bytes models' tracemalloc (which
    # made writing them 5 times slower) untraced
    refusals = []
    with NpzWriter(os.path.join(out, f"rank{rank}.npz")) as saved:
        for name, part in (spec["parts"].items() if mode == "parts" else [("", spec)]):
            if part["mode"] == "resume":
                init_bps()
                resume_and_save(part)
                continue
            run_part = {"diloco": diloco, "lm": lm}.get(part["mode"], native_or_hooked)
            got, refused = run_part(part, f"{name}/" if name else "")
            saved.add(got)
            refusals += refused
        saved.add({"refusals": np.array(refusals)})
    dist.barrier()
    dist.destroy_process_group()
