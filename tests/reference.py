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


def expected_results(spec, workers):
    """{'name/step': array} as every worker must see it."""
    pb, mcb = spec["partition_bytes"], spec["min_compress_bytes"]
    out = {}
    for index, t in enumerate(spec["tensors"]):
        params = CompressionParams.from_dict(t.get("params", {}))
        dtype = np.dtype(t["dtype"])
        wire = np.dtype(np.float16) if params.fp16 else dtype
        size = int(np.prod(t["shape"]))
        compressed = params.compressed and size * dtype.itemsize >= mcb
        parts = partitions(size, wire, pb)
        chains = {}
        for p, start, stop in parts:
            key = index << 16 | p
            if compressed:
                chains[p] = ([build_chain(params, stop - start, wire, key=key, role="worker")
                              for _ in range(workers)],
                             build_chain(params, stop - start, wire, key=key, role="server"))
        for step in range(spec["steps"]):
            lr = spec["lrs"][step]
            inputs = [gradient(r, step, t).reshape(-1).astype(wire) for r in range(workers)]
            result = np.empty(size, wire)
            for p, start, stop in parts:
                if compressed:
                    worker_chains, server_chain = chains[p]
                    decoded = [worker_chains[r].decompress(worker_chains[r].compress(inputs[r][start:stop], lr))
                               for r in range(workers)]
                else:
                    decoded = [inputs[r][start:stop] for r in range(workers)]
                # raw pushes: first copied, then added; decoded pushes: added to zeros
                acc = np.zeros(stop - start, wire) if compressed else decoded[0].copy()
                for d in decoded if compressed else decoded[1:]:
                    acc += d
                if compressed:
                    acc = server_chain.decompress(server_chain.compress(acc, lr))
                if t.get("average", True):
                    acc /= acc.dtype.type(workers)
                result[start:stop] = acc
            out[f"{t['name']}/{step}"] = result.astype(dtype).reshape(t["shape"])
    return out
