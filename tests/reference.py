"""What a push_pull must return, recomputed in one process with plain numpy and the codecs:
each worker's chain, then the server's rank-ordered sum, error feedback and recompression."""
import zlib

import numpy as np

from bps_gc.compress import CompressionParams, build_chain


def gradient(rank, step, tensor):
    """The deterministic input of ``rank`` at ``step`` for a tensor description."""
    seed = zlib.crc32(f"{tensor['name']}/{rank}/{step}".encode())
    x = np.random.default_rng(seed).standard_normal(tensor["shape"]) * tensor.get("scale", 1.0)
    return x.astype(tensor["dtype"])


def partitions(size, wire_dtype, partition_bytes):
    per = max(1, partition_bytes // np.dtype(wire_dtype).itemsize)
    return [(p, p * per, min(size, (p + 1) * per)) for p in range(max(1, -(-size // per)))]


class PushPullModel:
    """One declared tensor (the ``index``-th declaration) across ``workers`` processes:
    ``step(inputs, lr)`` is what every worker pulls for these per-rank inputs."""

    def __init__(self, params, shape, dtype, index, workers, partition_bytes, min_compress_bytes,
                 average=True):
        self.params = CompressionParams.from_dict(params or {})
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.wire = np.dtype(np.float16) if self.params.fp16 else self.dtype
        self.size = int(np.prod(shape))
        self.workers, self.average = workers, average
        self.compressed = self.params.compressed and self.size * self.dtype.itemsize >= min_compress_bytes
        self.parts = partitions(self.size, self.wire, partition_bytes)
        self.chains = {}
        for p, start, stop in self.parts:
            if self.compressed:
                key = index << 16 | p
                self.chains[p] = ([build_chain(self.params, stop - start, self.wire, key=key, role="worker")
                                   for _ in range(workers)],
                                  build_chain(self.params, stop - start, self.wire, key=key, role="server"))

    def step(self, inputs, lr):
        flat = [np.asarray(x).reshape(-1).astype(self.wire) for x in inputs]
        result = np.empty(self.size, self.wire)
        for p, start, stop in self.parts:
            if self.compressed:
                worker_chains, server_chain = self.chains[p]
                decoded = [worker_chains[r].decompress(worker_chains[r].compress(flat[r][start:stop], lr))
                           for r in range(self.workers)]
            else:
                decoded = [flat[r][start:stop] for r in range(self.workers)]
            # raw pushes: first copied, then added; decoded pushes: added to zeros
            acc = np.zeros(stop - start, self.wire) if self.compressed else decoded[0].copy()
            for d in decoded if self.compressed else decoded[1:]:
                acc += d
            if self.compressed:
                acc = server_chain.decompress(server_chain.compress(acc, lr))
            if self.average:
                acc /= acc.dtype.type(self.workers)
            result[start:stop] = acc
        return result.astype(self.dtype).reshape(self.shape)


def expected_results(spec, workers):
    """{'name/step': array} as every worker must see it."""
    out = {}
    for index, t in enumerate(spec["tensors"]):
        model = PushPullModel(t.get("params"), t["shape"], t["dtype"], index, workers,
                              spec["partition_bytes"], spec["min_compress_bytes"], t.get("average", True))
        for step in range(spec["steps"]):
            inputs = [gradient(r, step, t) for r in range(workers)]
            out[f"{t['name']}/{step}"] = model.step(inputs, spec["lrs"][step])
    return out
