"""What a push_pull must return, recomputed in one process with plain numpy and the codecs:
each worker's chain, then the server's reduction by the tensor's reducer, written out here
again in numpy: recompress (rank-ordered sum, error feedback and recompression), lossless
(the rank-ordered sum itself) or majority (the sign of the sum of signs, +1 on ties)."""
import zlib

import numpy as np

from bps_gc.compress import CompressionParams, build_chain
from bps_gc.compress.registry import COMPRESSORS


def gradient(rank, step, tensor):
    """The deterministic input of ``rank`` at ``step`` for a tensor description."""
    seed = zlib.crc32(f"{tensor['name']}/{rank}/{step}".encode())
    x = np.random.default_rng(seed).standard_normal(tensor["shape"]) * tensor.get("scale", 1.0)
    if "disjoint" in tensor:  # only ``disjoint`` entries of its own, after the other ranks'
        k = tensor["disjoint"]
        block = x.reshape(-1)[:k] + np.sign(x.reshape(-1)[:k]) * 10  # well above zero
        x = np.zeros(tensor["shape"])
        x.reshape(-1)[rank * k:(rank + 1) * k] = block
    return x.astype(tensor["dtype"])


def step_ctx(spec, step):
    """The step context cluster_job.py pushes at ``step``."""
    return {"lr": spec["lrs"][step], "step": step, "epoch": step // 2, **spec.get("ctx", {})}


def partitions(size, wire_dtype, partition_bytes):
    per = max(1, partition_bytes // np.dtype(wire_dtype).itemsize)
    return [(p, p * per, min(size, (p + 1) * per)) for p in range(max(1, -(-size // per)))]


class PushPullModel:
    """One declared tensor (the ``index``-th declaration) across ``workers`` processes:
    ``step(inputs, lr)`` is what every worker pulls for these per-rank inputs."""

    def __init__(self, params, shape, dtype, index, workers, partition_bytes, min_compress_bytes,
                 average=True, reducer=None, half_in_float32=True):
        self.params = CompressionParams.from_dict(params or {})
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.wire = np.dtype(np.float16) if self.params.fp16 else self.dtype
        self.size = int(np.prod(shape))
        self.workers, self.average = workers, average
        self.half_in_float32 = half_in_float32
        self.reducer = reducer or (COMPRESSORS[self.params.compressor].reducers[0]
                                   if self.params.compressed else "sum")
        self.compressed = self.params.compressed and self.size * self.dtype.itemsize >= min_compress_bytes
        self.parts = partitions(self.size, self.wire, partition_bytes)
        self.chains = {}
        for p, start, stop in self.parts:
            if self.compressed:
                key = index << 16 | p
                self.chains[p] = ([build_chain(self.params, stop - start, self.wire, key=key, role="worker")
                                   for _ in range(workers)],
                                  build_chain(self.params, stop - start, self.wire, key=key, role="server"))

    def step(self, inputs, ctx):
        flat = [np.asarray(x).reshape(-1).astype(self.wire) for x in inputs]
        result = np.empty(self.size, self.wire)
        for p, start, stop in self.parts:
            if self.compressed:
                worker_chains, server_chain = self.chains[p]
                decoded = [worker_chains[r].decompress(worker_chains[r].compress(flat[r][start:stop], ctx))
                           for r in range(self.workers)]
            else:
                decoded = [flat[r][start:stop] for r in range(self.workers)]
            # raw pushes: first copied, then added (float16 in float32, rounded once: the
            # servers', wire/half.py; in float16, in rank order, where a host's ranks sum them
            # alone: comm/host_sum.py); decoded pushes: added to zeros
            servers_half = self.wire == np.float16 and self.half_in_float32 and not self.compressed
            adder = np.float32 if servers_half else self.wire
            acc = np.zeros(stop - start, self.wire) if self.compressed else decoded[0].astype(adder)
            for d in decoded if self.compressed else decoded[1:]:
                acc += d
            average = self.average
            if servers_half and average:  # the servers divide before their one rounding
                acc /= np.float32(self.workers)
                average = False
            acc = acc.astype(self.wire)
            if self.compressed and self.reducer == "recompress":
                acc = server_chain.decompress(server_chain.compress(acc, ctx))
            elif self.compressed and self.reducer == "majority":
                votes = sum(np.sign(d).astype(np.int64) for d in decoded)
                acc = np.where(votes < 0, -1, 1).astype(self.wire)
                average = False  # a vote is not averaged
            if average:
                acc /= acc.dtype.type(self.workers)
            result[start:stop] = acc
        return result.astype(self.dtype).reshape(self.shape)


def expected_results(spec, workers, servers_sum=True):
    """{'name/step': array} as every worker must see it; ``servers_sum=False``: the dense tensors
    are summed by the workers of one host alone (BPS_GC_LOCAL_REDUCE), float16 in float16."""
    out = {}
    for index, t in enumerate(spec["tensors"]):
        model = PushPullModel(t.get("params"), t["shape"], t["dtype"], index, workers,
                              spec["partition_bytes"], spec["min_compress_bytes"], t.get("average", True),
                              t.get("reducer"), half_in_float32=servers_sum)
        for step in range(spec["steps"]):
            inputs = [gradient(r, step, t) for r in range(workers)]
            out[f"{t['name']}/{step}"] = model.step(inputs, step_ctx(spec, step))
    return out


def elastic_means(spec, sequence, last):
    """BPS_GC_ELASTIC: yields (step, {name: mean}) for steps 0..``last``, each step's members
    from ``sequence`` [(first step, members)]; a rank that (re)joins at a step starts a fresh
    codec chain there (its codec state is zero); the servers' chains live on."""
    lrs = {"lrs": [0.1] * (last + 1)}
    tensors = []
    for index, t in enumerate(spec["tensors"]):
        params = CompressionParams.from_dict(t.get("params", {}))
        n = int(np.prod(t["shape"]))
        parts = partitions(n, np.float32, spec["partition_bytes"])

        def chain(p, a, b, role, params=params, index=index):
            return build_chain(params, b - a, np.float32, key=index << 16 | p, role=role)
        servers = {p: chain(p, a, b, "server") for p, a, b in parts} if params.compressed else {}
        tensors.append((t, params, n, parts, chain, servers, {}))
    previous = []
    for step in range(last + 1):
        members = [m for first, m in sequence if first <= step][-1]
        ctx = step_ctx(dict(spec, **lrs), step)
        means = {}
        for t, params, n, parts, chain, servers, workers in tensors:
            if params.compressed:
                for r in set(members) - set(previous):
                    workers[r] = {p: chain(p, a, b, "worker") for p, a, b in parts}
            x = {r: gradient(r, step, t).reshape(-1) for r in members}
            result = np.empty(n, np.float32)
            for p, a, b in parts:
                if params.compressed:
                    acc = np.zeros(b - a, np.float32)
                    for r in members:
                        acc += workers[r][p].decompress(workers[r][p].compress(x[r][a:b], ctx))
                    acc = servers[p].decompress(servers[p].compress(acc, ctx))
                else:
                    acc = x[members[0]][a:b].copy()
                    for r in members[1:]:
                        acc += x[r][a:b]
                result[a:b] = acc / np.float32(len(members))
            means[t["name"]] = result
        previous = members
        yield step, means
