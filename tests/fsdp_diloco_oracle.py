"""The recomputation of bps_gc.torch.DiLoCo over the tests' MLP sharded with FSDP2 inside each
replica (fsdp_job.py mode "diloco", a (2, 2) mesh: rank = 2 x replica + shard; fsdp_ps_job.py's
spec "diloco", 2 hosts x 2 local ranks: rank = 2 x host + local rank), in one process
with torch alone: each replica an unsharded copy of the model, its inner SGD step on the mean
of its two ranks' gradients (what FSDP2's reduce-scatter hands each shard), and every
``sync_every`` steps the replicas' pseudo-gradients (global copy - local) averaged (dense, or
each parameter's shards through the numpy chains of fsdp_inhost_oracle.expected_call, named
``<fqn>#shard<i>``), the paper's outer step on the global copy (torch's SGD, lr 0.7, momentum 0.9,
Nesterov), and both replicas restarted from it."""
import copy
import itertools

import numpy as np
import torch

from fsdp_inhost_oracle import PARAMS, expected_call

WIDTHS = (16, 32, 32, 8)
RECOMPUTATIONS = itertools.count()


def batch(rank, step):
    """fsdp_job.train's batch of ``rank`` at ``step`` (one micro-batch)."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step)
    return torch.randn(4, WIDTHS[0], generator=g), torch.randn(4, WIDTHS[-1], generator=g)


def averaged(pseudo, sync, params, run):
    """{name: the replicas' averaged pseudo-gradient} (``pseudo``: each replica's {name: tensor})."""
    if params is None:
        return {name: (pseudo[0][name] + pseudo[1][name]) / 2 for name in pseudo[0]}
    out = {}
    for name, shape in PARAMS:
        rows = shape[0] // 2  # the MLP's rows split evenly over 2 shards
        shards = [expected_call([p[name].numpy()[rows * i:rows * (i + 1)].reshape(-1) for p in pseudo], i,
                                [(name, shape)], sync, run=run, params=params) for i in range(2)]
        out[name] = torch.from_numpy(np.concatenate(shards).reshape(shape))
    return out


def diloco_reference(steps, sync_every, params=None, batch_of=batch):
    """[[{name: float32 array} of each replica] after every step]; ``batch_of(rank, step)``: the
    job's batches (fsdp_job's by default). Its chains are its own: fsdp_inhost_oracle.CHAINS
    keeps chains (their residuals) by run for the calls of one recomputation, so each
    recomputation names a run no other has (tests of one process call it more than once)."""
    run = f"diloco{next(RECOMPUTATIONS)}"
    torch.manual_seed(0)  # fsdp_job.build's model
    model = torch.nn.Sequential(torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[1], WIDTHS[2]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[2], WIDTHS[3]))
    replicas = [copy.deepcopy(model) for _ in range(2)]
    inner = [torch.optim.SGD(m.parameters(), lr=0.1) for m in replicas]
    global_copy = {name: p.detach().clone() for name, p in model.named_parameters()}
    outer = torch.optim.SGD(list(global_copy.values()), lr=0.7, momentum=0.9, nesterov=True)
    history = []
    for step in range(steps):
        for r, (m, opt) in enumerate(zip(replicas, inner)):
            grads = []
            for rank in (2 * r, 2 * r + 1):
                x, y = batch_of(rank, step)
                m.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                grads.append([p.grad.clone() for p in m.parameters()])
            for p, a, b in zip(m.parameters(), *grads):
                p.grad = (a + b) / 2
            opt.step()
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                pseudo = [{name: global_copy[name] - p for name, p in m.named_parameters()} for m in replicas]
                for name, mean in averaged(pseudo, (step + 1) // sync_every - 1, params, run).items():
                    global_copy[name].grad = mean
                outer.step()
                for m in replicas:
                    for name, p in m.named_parameters():
                        p.copy_(global_copy[name])
        history.append([{name: p.detach().numpy().copy() for name, p in m.named_parameters()} for m in replicas])
    return history


def diloco_on_hosts_equals_the_recomputation(ranks, runs, steps, names):
    """fsdp_ps_job.py's spec "diloco" ``runs`` ({run: {"params", "outer_step"}}), 2 hosts x 2
    local ranks, ``steps`` steps, the MLP's parameters ``names``:
    bps_gc.torch.DiLoCo(..., replicate="hosts") over the MLP sharded on each host's 2 local
    ranks (no hooks: FSDP2's reduce-scatter averages the inner gradients in the host), H = 2: each local rank pushes its own shards (``<fqn>#shard<i>``, one push per host), and
    every rank's full parameters after every step equal fsdp_diloco_oracle's one-process
    recomputation (two unsharded replicas, the paper's outer step) within 1e-6, replicas
    bit-identical after each sync and apart between; a model sharded on another mesh, one
    partly sharded, and elastic_start on a sharded host replica are refused in one line."""
    def batch_of(rank, step):  # fsdp_ps_job.batch
        g = torch.Generator().manual_seed(1000 * rank + step)
        return torch.randn(4, WIDTHS[0], generator=g), torch.randn(4, WIDTHS[-1], generator=g)
    for run, setting in runs.items():
        want = diloco_reference(steps, 2, setting.get("params"), batch_of)
        assert [str(a[f"{run}/outer_step"]) for a in ranks] == [setting.get("outer_step", "servers")] * 4, run
        for step in range(steps):
            for r in range(4):
                for name in names:
                    np.testing.assert_allclose(ranks[r][f"{run}/full/{step}/{name}"], want[step][r // 2][name],
                                               rtol=1e-6, atol=1e-7, err_msg=f"{run} step {step} rank {r} {name}")
            same = ranks[0][f"{run}/full/{step}/0.weight"].tobytes() == ranks[2][f"{run}/full/{step}/0.weight"].tobytes()
            assert same == (step % 2 == 1), (run, step)
    refused = {str(a["diloco_refusal"]) for a in ranks}
    assert len(refused) == 2 and all(r.startswith("DiLoCo: replicate='hosts' over a sharded model: '0.weight' is "
                                                  "sharded on a 1-D mesh of 1 ranks as shard 0, but this rank is "
                                                  "local rank ") and "shard the model on bps_gc.torch.host_mesh()" in r
                                     and "\n" not in r for r in refused), refused
    elastic = {str(a[f"{run}/elastic_refusal"]) for a in ranks for run in runs}
    assert elastic == {"DiLoCo: elastic_start: a model sharded with FSDP2 takes no elastic membership "
                       "(BPS_GC_ELASTIC): a joining host's ranks would each need their shard's state"}, elastic
    whole = {str(a["diloco_refusal_whole"]) for a in ranks}
    assert whole == {"DiLoCo: replicate='hosts' over a sharded model: '1.weight' is not sharded: shard every "
                     "parameter on bps_gc.torch.host_mesh() (fully_shard the root module too)"}, whole
