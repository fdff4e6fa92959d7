"""The numpy recomputations of tests/test_fsdp_ps.py (FSDP2 with the parameter server as the
replicate reducer, tests/fsdp_ps_job.py): HSDP's parameters over the job's ranks, and every hook
call of a run through its codec's own server path, with the bytes each rank pushes and pulls."""
import numpy as np
import torch

from bps_gc import compress
from bps_gc.compress import CompressionParams, build_chain

HOSTS, LR = 2, 0.1
WIDTHS = (16, 32, 32, 8)  # fsdp_ps_job's MLP
LAYERS = {1: "0", 2: "2", 3: "4"}  # FSDPModule index (the root first, holding none) -> its layer
NAMES = [f"{layer}.{param}" for layer in LAYERS.values() for param in ("weight", "bias")]
PHASED_REDUCERS = ("thc", "powersgd")  # their phases summed by the servers (comm/phased.py)


def hsdp_reference(ranks, steps):
    """The MLP after ``steps`` SGD steps on the mean gradient of ``ranks`` ranks' batches."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[1], WIDTHS[2]), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTHS[2], WIDTHS[3]))
    for step in range(steps):
        grads = []
        for rank in range(ranks):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(4, WIDTHS[0], generator=g), torch.randn(4, WIDTHS[-1], generator=g)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.double() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= LR * (sum(g[i] for g in grads) / len(grads)).float()
    return {name: p.detach().numpy() for name, p in model.named_parameters()}


def shards_of_call(arrays, run, call):
    """[(name, start, stop)] of the shards in hook call ``call`` of ``run``, in its output."""
    layer, out, offset = LAYERS[int(arrays[f"{run}/calls"][call])], [], 0
    shard = [k for k in arrays if k.startswith(f"{run}/keys/{layer}.weight#shard")][0].rsplit("#", 1)[1]
    for param in ("weight", "bias"):
        name = f"{layer}.{param}#{shard}"
        size = int(arrays[f"{run}/keys/{name}"][-1, 2])
        out.append((name, offset, offset + size))
        offset += size
    return out


def expected_calls(ranks, run, params, local, rounded=False):
    """Every hook call's output of shard i's ranks (HOSTS x ``local``), recomputed: each host's
    chain (seeded by the shard's key and the pushing rank) compresses its reduce-scatter output,
    the server reduces the pushes with the codec's default reducer (re-compresses their sum;
    DGC's exact sum; sign's majority vote, not divided), the result is divided by the hosts;
    thc and PowerSGD sum their hosts' first phase, then their second, and finish. Also each
    rank's bytes pushed and pulled: its chain's payloads, the server's replies. ``params``: the
    run's compression_params; ``rounded``: its outputs rounded into bfloat16 (the bfloat16
    reduce dtype, reduced in float32)."""
    params = CompressionParams.from_dict(params)
    reducer = compress.choose_reducer(params)
    expected, wire = {}, np.zeros((HOSTS * local, 2), np.int64)
    for i in range(local):
        arrays = ranks[i]
        chains = {}
        for call in range(len(arrays[f"{run}/calls"])):
            step = call // len(LAYERS)
            ctx = {"lr": 0.0, "step": step, "epoch": 0}
            out = np.empty_like(arrays[f"{run}/call{call}/in"])
            for name, start, stop in shards_of_call(arrays, run, call):
                shape = tuple(int(s) for s in arrays[f"{run}/shape/{name}"])
                for key, p_start, p_stop in arrays[f"{run}/keys/{name}"].tolist():
                    n = p_stop - p_start
                    if key not in chains:
                        chains[key] = ([build_chain(params, n, np.float32, key=key, role="worker", shape=shape,
                                                    rank=h * local + i) for h in range(HOSTS)],
                                       build_chain(params, n, np.float32, key=key, role="server"))
                        for chain in chains[key][0]:
                            if hasattr(chain, "set_summands"):  # thc: lanes for the hosts' pushes, int64 words
                                chain.set_summands(HOSTS, np.int64)
                    workers, server = chains[key]
                    xs = [ranks[h * local + i][f"{run}/call{call}/in"][start + p_start:start + p_stop]
                          for h in range(HOSTS)]
                    out[start + p_start:start + p_stop] = reduced(workers, server, xs, ctx, reducer, wire[i::local])
            if rounded:  # reduced in float32, rounded back into the bfloat16 output
                out = torch.from_numpy(out).to(torch.bfloat16).float().numpy()
            expected[(i, call)] = out
    return expected, wire


def reduced(workers, server, xs, ctx, reducer, wire):
    """One partition's result over the hosts' inputs ``xs`` (see expected_calls); adds each
    host's bytes pushed and pulled to ``wire`` (a row per host)."""
    if reducer in PHASED_REDUCERS:
        words = np.dtype(getattr(workers[0], "phase_dtype", np.float32))
        first = [w.compress(x, ctx).view(words) for w, x in zip(workers, xs)]
        second = [w.compress_q(sum(first)).view(words) for w in workers]
        outs = [w.finish(sum(second), np.empty(len(xs[0]), np.float32), HOSTS) for w in workers]
        assert all(np.array_equal(out, outs[0], equal_nan=True) for out in outs)  # every host's finish alike
        wire[:, 0] += first[0].nbytes + second[0].nbytes
        wire[:, 1] += first[0].nbytes + second[0].nbytes
        return outs[0] / np.float32(HOSTS)
    acc = np.zeros(len(xs[0]), np.float32)
    for h, (w, x) in enumerate(zip(workers, xs)):
        payload = w.compress(x, ctx)
        acc += w.decompress(payload)
        wire[h, 0] += memoryview(payload).nbytes
    if reducer == "majority":  # +-1, +1 on a tie; one bit an element and a non-finite byte
        wire[:, 1] += -(-len(acc) // 8) + 1
        return np.where(acc < 0, np.float32(-1), np.float32(1))
    if reducer == "lossless":  # (uint32 index, float32 value) records of the nonzeros while shorter than the sum
        wire[:, 1] += min(8 * np.count_nonzero(acc), 4 * len(acc))
        return acc / np.float32(HOSTS)
    reply = server.compress(acc, ctx)
    wire[:, 1] += memoryview(reply).nbytes
    return server.decompress(reply) / np.float32(HOSTS)
