"""FSDP2 with the parameter server as the replicate reducer, under ``bpslaunch`` (hosts x local
ranks): ``python fsdp_ps_job.py SPEC.json OUT``. Each rank joins (bps.init()), makes the host's
group (bps.host_mesh()), and trains one MLP per spec "runs" entry (name: compression_params,
null: dense), sharded over the host's local ranks with fully_shard's options of its spec
"policies" entry (POLICIES: mixed precision, CPU offload) and hooked with
register_fsdp_hooks(model, None, params), ``steps`` SGD steps on its own batches (spec
"widths": the MLP's, default 16-32-32-8; spec "run_steps" {name: steps}: a run's own, if
fewer). Saved per run, prefixed "<run>/": the full parameters
at the end, its local shards after every step, every hook call's reduce-scatter output before
and after (widened to float32), the partitions (key, start, stop) of each shard's declared
tensor, the bytes bps.metrics() counted in its steps, the codec state bps_gc's state_dict
holds of them and how many of its shards went through device chains. A run named in spec "in_host"
(name: shard_compression_params) compresses FSDP2's in-host reduce-scatter too; also saved: each
reduce-scatter's input and output ("rs<i>/in", "rs<i>/out", module index "rs_calls"), the
``in_host_*`` bytes of bps.metrics() and the in-host codec state's bytes ("state_in_host").
Then refused, each message saved: a model sharded on a mesh that is not the host's
("refusal"), TernGrad on a float64 reduce dtype across hosts ("unfit") and in the host
("unfit_in_host"), and register_fsdp_hooks(model, None) before bps.init() ("unserved"); a
bfloat16 push_pull every rank makes, which the host would sum, is refused in one line (asserted here).

Spec "diloco_runs" [names]: those runs train with DiLoCo (replicate="hosts", H = 3, no hooks),
saved and resumed as the others are (their own state in OUT/diloco<rank>.pt). Spec "diloco":
DiLoCo over the sharded MLP, each host one replica (``diloco`` below), and its
refusals of a model sharded on another mesh ("diloco_refusal") and of one partly sharded
("diloco_refusal_whole").

Spec "lm": the LM's GPT (lm_hsdp_case.py) sharded over the host's local ranks, each block and
then the root, as the yardstick shards it, through the dense hooks (register_fsdp_hooks(model,
None)), trained lm_hsdp_case.STEPS steps: its full parameters ("lm/full/<name>").

Spec "save" {"runs": [names], "at": k}: those runs (the first of "runs", in order) train
together, a step of each in turn, with SGD momentum; before step k their models and optimizers
are saved with torch.distributed.checkpoint over the host's group (OUT/dcp<host>) and bps_gc's
state in OUT/bps<rank>.pt. Spec "resume" {"from": DIR, "at": k, "runs": {name: params}, "codecs":
bool, "refused": bool}: those runs train together first, from step k after loading DIR's
checkpoint and (unless "codecs" is false) bps_gc's state; their arrays in OUT/resumed<rank>.npz
("refused": DIR is another mesh's, whose bps_gc state must be refused: its message,
"<run>/refused", and the full parameters dcp loaded, resharded, "<run>/loaded/<name>", instead).
Spec "fault" (tests/job_faults.py: "victim", "fault"): after the runs, top-k + EF (in the host
too with a spec "in_host") trains until the victim's fault."""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
import bps_gc.core as core  # noqa: E402
import bps_gc.torch as bps  # noqa: E402
from bps_gc.torch.device import device_chain_names  # noqa: E402
from bps_gc.compress.stateful import StateError  # noqa: E402
from fsdp_recording import record_calls, record_reduce_scatters  # noqa: E402
from job_faults import fault_at  # noqa: E402
from npz_files import savez  # noqa: E402

spec, out = json.load(open(sys.argv[1])), sys.argv[2]
torch.set_num_threads(1)
WIDTHS = tuple(spec.get("widths", (16, 32, 32, 8)))


MOMENTUM = 0.9  # the runs saved and resumed together (spec "save", "resume"): optimizer state to carry
POLICIES = {  # fully_shard's options of spec "policies" (run name: policy)
    "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
    "bf16r": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)},
    "f16r": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)},
    "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)},  # pinned memory needs an accelerator
    "fp64r": {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float64)},
}


def build(shard_mesh, policy=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[1], WIDTHS[2]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[2], WIDTHS[3]))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=shard_mesh, **POLICIES.get(policy, {}))
    fully_shard(model, mesh=shard_mesh, **POLICIES.get(policy, {}))
    return model


# before bps.init(): a model sharded on a group of this process alone, hooked with replicate=None
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    bps.register_fsdp_hooks(build(DeviceMesh.from_group(dist.group.WORLD, "cpu")), None)
    unserved = ""
except ValueError as e:
    unserved = str(e)
dist.destroy_process_group()
bps.init()
rank = bps.rank()
host = rank // bps.local_size()
mesh = bps.host_mesh()


def batch(step):
    """Rank ``rank``'s batch of ``step`` (the test recomputes it)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, WIDTHS[0], generator=g), torch.randn(4, WIDTHS[-1], generator=g)


IN_HOST = ("in_host_pushed_raw", "in_host_pushed_wire", "in_host_pulled_wire")  # metrics()' in-host step


class Run:
    """One model of spec "runs": sharded on the host's mesh with its spec "policies" entry, hooked
    with ``params`` (and its spec "in_host" entry, the in-host step's shard_compression_params,
    whose reduce-scatters are recorded), trained with SGD (``momentum``: optimizer state for the
    checkpoints)."""

    def __init__(self, name, params, momentum=0.0):
        self.name, self.model = name, build(mesh, spec.get("policies", {}).get(name))
        self.calls, self.rs_calls, self.arrays, self.pushed, self.pulled = [], [], {}, 0, 0
        self.in_host = dict.fromkeys(IN_HOST, 0)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=momentum)
        if name in spec.get("diloco_runs", ()):  # no hooks: DiLoCo, each host a replica, H = 3
            self.exchange, self.opt = None, bps.DiLoCo(self.model, self.opt, 3, replicate="hosts",
                                                       compression_params=params)
            return
        self.exchange = bps.register_fsdp_hooks(self.model, None, params,
                                                shard_compression_params=spec.get("in_host", {}).get(name))
        record_calls(self.model, self.calls)
        if self.exchange.in_host is not None:
            record_reduce_scatters(self.model, self.rs_calls)

    def step(self, step):
        bps.metrics()  # from here: this step's bytes (runs trained together count apart)
        x, y = batch(step)
        torch.nn.functional.mse_loss(self.model(x).float(), y).backward()  # bfloat16 parameters: its output
        self.opt.step()
        self.opt.zero_grad()
        counted = bps.metrics()
        self.pushed, self.pulled = self.pushed + counted.pushed_wire, self.pulled + counted.pulled_wire
        self.in_host = {k: v + getattr(counted, k) for k, v in self.in_host.items()}
        self.arrays.update({f"local/{step}/{n}": p.to_local().detach().numpy().copy()
                            for n, p in self.model.named_parameters()})

    def results(self):
        """Its arrays, prefixed "<name>/" (module doc)."""
        arrays = dict(self.arrays)
        arrays.update({f"full/{n}": p.full_tensor().detach().numpy() for n, p in self.model.named_parameters()})
        if self.exchange is None:  # a DiLoCo run: its parameters alone
            return {f"{self.name}/{k}": v for k, v in arrays.items()}
        arrays.update({f"call{i}/in": c[1] for i, c in enumerate(self.calls)})
        arrays.update({f"call{i}/out": c[2] for i, c in enumerate(self.calls)})
        arrays["calls"] = np.array([c[0] for c in self.calls])
        if self.rs_calls:  # the in-host step: its reduce-scatters, bytes and saved codec state
            arrays.update({f"rs{i}/{k}": v for i, c in enumerate(self.rs_calls) for k, v in zip(("in", "out"), c[1:3])})
            arrays["rs_calls"] = np.array([c[0] for c in self.rs_calls])
            arrays.update({k: np.array(v) for k, v in self.in_host.items()})
            arrays["state_in_host"] = np.array(sum(v.nbytes for v in self.exchange.in_host.hook.codec_state()
                                                   .state_dict().values() if isinstance(v, np.ndarray)))
        comm = core.communicator()
        for part, declared in self.exchange.keys.items():
            arrays[f"keys/{part}"] = np.array([(p.key, p.start, p.stop) for p in comm.tensors[declared].partitions],
                                              np.uint64).reshape(-1, 3)
            arrays[f"shape/{part}"] = np.array(comm.tensors[declared].shape)
        arrays["pushed_wire"], arrays["pulled_wire"] = np.array(self.pushed), np.array(self.pulled)
        # how many of its parts went through device chains (BPS_GC_DEVICE_CODECS=torch)
        arrays["device_chains"] = np.array(len(set(device_chain_names()) & set(self.exchange.keys.values())))
        return {f"{self.name}/{k}": v for k, v in arrays.items()}


def state_bytes(runs):
    """The codec state of each hooked run's shards this rank saves: its own chains'
    ("<run>/state_worker"), and (host 0's ranks) the servers' of the same shards
    ("<run>/state_server"), from one bps_gc state_dict() after the runs (one per run asked the
    servers for every run's state so far: quadratic in the runs)."""
    state, arrays = core.state_dict(), {}
    for one in (one for one in runs if one.exchange is not None):
        declared = set(one.exchange.keys.values())
        for side in ("worker", "server"):
            arrays[f"{one.name}/state_{side}"] = np.array(sum(
                v.nbytes for k, v in state.items()
                if isinstance(v, np.ndarray) and k.startswith(f"{side}/") and k.split("/")[1] in declared))
    return arrays


def train(runs, steps, save_at=None):
    """Train ``runs`` together, a step of each in turn; before step ``save_at`` save them."""
    for step in steps:
        if step == save_at:
            save(runs)
        for one in runs:
            one.step(step)


def inner(opt):
    """The torch optimizer torch.distributed.checkpoint saves: a DiLoCo's inner one."""
    return opt.inner if isinstance(opt, bps.DiLoCo) else opt


def dcp_state(runs):
    return {one.name: dict(zip(("model", "optim"), get_state_dict(one.model, inner(one.opt)))) for one in runs}


def save(runs):
    """The models and optimizers with torch.distributed.checkpoint (over the host's group: each
    host its own, OUT/dcp<host>), bps_gc's state (the codecs', the servers' of host 0's shards)."""
    dcp.save(dcp_state(runs), checkpoint_id=os.path.join(out, f"dcp{host}"))
    bps.save_checkpoint(bps.state_dict(), os.path.join(out, f"bps{rank}.pt"))
    torch.save({one.name: {k: v for k, v in one.opt.state_dict().items() if k != "inner"}  # DiLoCo's own
                for one in runs if isinstance(one.opt, bps.DiLoCo)}, os.path.join(out, f"diloco{rank}.pt"))


def load(runs, saved):
    """What ``save`` saved in ``saved``: the models and optimizers (resharded by dcp if the mesh
    differs), then bps_gc's state."""
    state = dcp_state(runs)
    dcp.load(state, checkpoint_id=os.path.join(saved, f"dcp{host}"))
    for one in runs:
        set_state_dict(one.model, inner(one.opt), model_state_dict=state[one.name]["model"],
                       optim_state_dict=state[one.name]["optim"])


def load_diloco(runs, saved):
    """The DiLoCo runs' own state (global copies, outer state, step count) that ``save`` saved."""
    own = torch.load(os.path.join(saved, f"diloco{rank}.pt"), weights_only=True)
    for one in runs:
        if isinstance(one.opt, bps.DiLoCo):
            one.opt.load_state_dict({**own[one.name], "inner": one.opt.inner.state_dict()})


if "resume" in spec:  # spec "resume": its runs, trained together from step "at", loaded from "from"
    resume = spec["resume"]
    runs, codec_state = [Run(name, params, MOMENTUM) for name, params in resume["runs"].items()], \
        os.path.join(resume["from"], f"bps{rank}.pt")
    if resume.get("refused"):  # saved on another mesh: bps_gc's state is refused, dcp reshards the rest
        try:
            bps.load_state_dict(bps.load_checkpoint(codec_state))
            raise AssertionError(f"rank {rank}: the state of {resume['from']} was loaded on another mesh")
        except StateError as e:
            refused = str(e)
        load(runs, resume["from"])
        resumed = {f"{one.name}/refused": np.array(refused) for one in runs}
        resumed.update({f"{one.name}/loaded/{n}": p.full_tensor().detach().numpy() for one in runs
                        for n, p in one.model.named_parameters()})
    else:
        load(runs, resume["from"])
        if resume.get("codecs", True):  # False: the codecs start afresh (the check that they matter)
            bps.load_state_dict(bps.load_checkpoint(codec_state))
        load_diloco(runs, resume["from"])
        train(runs, range(resume["at"], spec["steps"]))
        resumed = {**{k: v for one in runs for k, v in one.results().items()}, **state_bytes(runs)}
    savez(os.path.join(out, f"resumed{rank}.npz"), **resumed)

arrays = {"unserved": np.array(unserved)}
saved = spec.get("save", {"runs": []})  # the first runs, trained together and saved
together = [Run(name, spec["runs"][name], MOMENTUM) for name in saved["runs"]]
train(together, range(spec["steps"]), saved.get("at"))
for one in together:
    arrays.update(one.results())
every_run = list(together)
for name, params in spec["runs"].items():
    if name not in saved["runs"]:
        one = Run(name, params)
        train([one], range(spec.get("run_steps", {}).get(name, spec["steps"])))
        arrays.update(one.results())
        every_run.append(one)
arrays.update(state_bytes(every_run))


def diloco(name, setting, sync_every, steps):
    """Spec "diloco" {"runs": {name: {"params": compression_params, "outer_step": ...}},
    "sync_every", "steps"}: the MLP sharded on the host's mesh without hooks, bps_gc.torch.DiLoCo
    with replicate="hosts" (each host one replica, each local rank pushing its own shards) over
    its SGD; its full parameters after every step ("<name>/full/<step>/<param>"), where its
    outer step ran ("<name>/outer_step") and elastic_start's refusal ("<name>/elastic_refusal")."""
    model = build(mesh)
    opt = bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every, replicate="hosts",
                     compression_params=setting.get("params"), outer_step=setting.get("outer_step"))
    arrays = {f"{name}/outer_step": np.array(opt.outer_step)}
    for step in range(steps):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        arrays.update({f"{name}/full/{step}/{n}": p.full_tensor().detach().numpy() for n, p in model.named_parameters()})
    opt.wait()
    try:  # a sharded host replica takes no elastic membership: refused before anything is sent
        opt.elastic_start()
        arrays[f"{name}/elastic_refusal"] = np.array("")
    except ValueError as e:
        arrays[f"{name}/elastic_refusal"] = np.array(str(e))
    return arrays


for name, setting in spec.get("diloco", {}).get("runs", {}).items():
    arrays.update(diloco(name, setting, spec["diloco"]["sync_every"], spec["diloco"]["steps"]))
if spec.get("lm"):
    import lm_hsdp_case
    from hsdp import fully_shard_gpt
    net = lm_hsdp_case.model()
    fully_shard_gpt(net, mesh)
    bps.register_fsdp_hooks(net, None)
    arrays.update({f"lm/full/{name}": p for name, p in lm_hsdp_case.train(net, rank).items()})
# a model sharded on a mesh other than the host's local ranks (each rank alone): refused
alone = [dist.new_group([r]) for r in range(bps.local_size())][bps.local_rank()]
if "diloco" in spec:  # so is DiLoCo's replicate="hosts" over it
    partly = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(partly[0], mesh=mesh)  # the second layer left whole
    for refused, model in (("diloco_refusal", build(DeviceMesh.from_group(alone, "cpu"))),
                           ("diloco_refusal_whole", partly)):
        try:
            bps.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, replicate="hosts")
            arrays[refused] = np.array("")
        except ValueError as e:
            arrays[refused] = np.array(str(e))
for refused, model, params in (("refusal", build(DeviceMesh.from_group(alone, "cpu")), None),
                               # a codec that cannot take the reduce dtype (float64), across hosts, in the host
                               ("unfit", build(mesh, "fp64r"), {"compressor": "terngrad"}),
                               ("unfit_in_host", build(mesh, "fp64r"), {"in_host": {"compressor": "terngrad"}})):
    try:
        in_host = (params or {}).pop("in_host", None)
        bps.register_fsdp_hooks(model, None, params or None, shard_compression_params=in_host)
        arrays[refused] = np.array("")
    except (TypeError, ValueError) as e:
        arrays[refused] = np.array(str(e))
try:  # bfloat16 every rank pushes: the host would sum it in shared memory (numpy has no bfloat16)
    bps.push_pull(torch.ones(4, dtype=torch.bfloat16), name="bf16.every")
    raise SystemExit("a bfloat16 tensor the host sums was accepted")
except TypeError as e:
    assert str(e).startswith("declare('bf16.every'): dtype torch.bfloat16 is not supported here: 'bf16.every': "
                             "bfloat16 is pushed dense") and "no host's sum (BPS_GC_LOCAL_REDUCE, two levels)" in str(e) \
        and "autocast" in str(e) and "\n" not in str(e), e
savez(os.path.join(out, f"rank{rank}.npz"), **arrays)
if "fault" in spec:  # train until told to stop; rank spec "victim" does spec "fault" at step 3
    model = build(mesh)
    topk = {"compressor": "topk", "k": 0.25, "ef": "vanilla"}
    bps.register_fsdp_hooks(model, None, topk, shard_compression_params=topk if spec.get("in_host") else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10**6):
        fault_at(step, 3, rank, spec, out)
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
bps.shutdown()
