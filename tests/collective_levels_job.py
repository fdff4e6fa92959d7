"""The two-level pieces a DDP hook calls (bps_gc.collective.levels), then tests/cluster_job.py:
``python collective_levels_job.py SPEC.json OUT_DIR``. The hook's levels are its own
(levels_from_env: groups and memory apart from the communicator's): a dense torch tensor summed
by reduce_tensor, and one bucket of two compressed gradients by reduce_coded_on_hosts, each gradient's
owner local rank compressing its host's sum once; all_reduce_cuda (NCCL's path) on a CPU tensor of
7 floats. Then the DDP hook (bps_gc.torch.comm_hook) on a
small network, dense, topk + EF and thc (HOOK_MODES), recording every bucket it saw: index, gradient
sizes, this rank's gradients in and the averaged bucket out. Saves OUT_DIR/levels<rank>.npz.
Every dense two-level sum of this process (the hook's and then cluster_job.py's communicator's)
runs in stripes of PIPELINE_BYTES (levels.py's pipeline), many stripes per tensor here.
"""
import json
import os
import runpy
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402
from bps_gc import compress  # noqa: E402
from bps_gc.collective.coded import CodedPart  # noqa: E402
from bps_gc.collective import levels as levels_module  # noqa: E402
from bps_gc.collective.levels import levels_from_env  # noqa: E402
from bps_gc.collective.exchange.two_levels import reduce_coded_on_hosts  # noqa: E402
from bps_gc.compress.registry import COMPRESSORS  # noqa: E402
from bps_gc.comm.placement import partition_owner  # noqa: E402
from reference import gradient, step_ctx  # noqa: E402

HOOK_TENSORS = [{"name": "hook-dense", "shape": [500], "dtype": "float32", "params": {}},
                {"name": "hook-onebit", "shape": [300], "dtype": "float32",
                 "params": {"compressor": "onebit", "scaling": True, "ef": "vanilla"}},
                {"name": "hook-topk", "shape": [200], "dtype": "float32",
                 "params": {"compressor": "topk", "k": 0.1}}]
HOOK_INDEX = 100  # the gradients' keys: (HOOK_INDEX + position) << 16, one partition each
HOOK_MODES = {"ddp-dense": {}, "ddp-topk-ef": {"compressor": "topk", "k": 0.1, "ef": "vanilla"},
              "ddp-thc-ef": {"compressor": "thc", "bits": 4, "feedback": True}}  # host sums first
HOOK_STEPS, HOOK_LR = 3, 0.1  # DDP regroups its buckets after the first step
PIPELINE_BYTES = 64  # 16 floats a share: the 1,100-float tensors cross hosts in 23 stripes


def run_hook(params, rank):
    """HOOK_STEPS steps of DDP with the hook; {name: array} of every bucket it saw, in call order."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from bps_gc.torch import comm_hook
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 10)),
                bucket_cap_mb=0.001)  # a few buckets of ~250 floats
    opt = torch.optim.SGD(model.parameters(), lr=HOOK_LR)
    hook, seen = comm_hook(params, optimizer=opt), []
    position = {id(p): i for i, p in enumerate(model.parameters())}

    def recording(state, bucket):  # stays asynchronous: the result is read when the future completes
        entry = [bucket.index(), [g.numel() for g in bucket.gradients()], bucket.buffer().detach().clone().numpy(),
                 [position[id(p)] for p in bucket.parameters()]]
        seen.append(entry)
        return hook(state, bucket).then(lambda f: entry.append(f.value().detach().clone().numpy()) or f.value())
    model.register_comm_hook(None, recording)
    for step in range(HOOK_STEPS):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 10, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for k, (index, sizes, grads, params, result) in enumerate(seen):
        out.update({f"index{k}": np.array(index), f"sizes{k}": np.array(sizes), f"in{k}": grads, f"out{k}": result,
                    f"params{k}": np.array(params)})
    return out

if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    levels_module.PIPELINE_BYTES = PIPELINE_BYTES
    bps.init()
    rank, ctx = bps.rank(), step_ctx(spec, 0)
    levels = levels_from_env()
    assert levels is not None, "the job runs two levels"
    dense = torch.from_numpy(gradient(rank, 0, HOOK_TENSORS[0]).astype(np.float32))
    levels.reduce_tensor(dense)
    coded = HOOK_TENSORS[1:]
    flat = np.concatenate([gradient(rank, 0, t).astype(np.float32).reshape(-1) for t in coded])
    parts, start = [], 0
    for position, t in enumerate(coded):
        n, index = int(np.prod(t["shape"])), HOOK_INDEX + position
        params, key = compress.CompressionParams.from_dict(t["params"]), index << 16
        reducer = COMPRESSORS[params.compressor].reducers[0]
        parts.append(CodedPart(start, start + n, compress.build_chain(params, n, np.float32, key=key, role="worker"),
                               compress.make_reducer(reducer, params, n, np.float32, key), ctx,
                               owner=partition_owner(index, 0, levels.local_size)))
        start += n
    reduce_coded_on_hosts(levels, [flat], [(flat, None)], parts)
    # all_reduce_cuda's three steps (NCCL's on a GPU) on a CPU tensor: gloo runs them too
    nccl_path = levels.all_reduce_cuda(torch.arange(7, dtype=torch.float32) * (rank + 1))
    levels.close()
    saved = {"hook-dense": dense.numpy(), "coded": flat, "nccl-path": nccl_path.numpy()}
    for mode, params in HOOK_MODES.items():
        saved.update({f"{mode}/{name}": value for name, value in run_hook(params, rank).items()})
    np.savez(os.path.join(sys.argv[2], f"levels{rank}.npz"), **saved)
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_job.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
