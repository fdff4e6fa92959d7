#!/usr/bin/env python3
"""A parameter server's CPU per round for one codec (issue 35's target: thc <= 0.3x onebit+EF
recompress): the server's own per-key code (ps/server/keys.KeyState.compute) on every key
of a round of ResNet-50 v1b's compressed gradients, the pushes made by the workers' real
chains, in one process: the CPU the servers spend reducing, without the sockets (thc's phase
buffers are more bytes to receive than onebit's payloads; that I/O is not counted here).

  onebit+EF (recompress): each 4 MB partition's N payloads decoded, summed, error feedback
                          and re-encoded (BytePS's server).
  thc 4-bit (+EF):        each partition's two phase buffers (the scale histogram, then the
                          packed codes for N summands) are uncompressed float64 keys of
                          BPS_GC_DENSE_PARTITION_BYTES (1 MB across hosts): the server adds them.

    python scripts/bench_server_cpu.py --workers 2 --rounds 5
    python scripts/bench_server_cpu.py --workers 8 --tensors 40
Numbers are thread CPU seconds per round (time.thread_time), the median over the rounds.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import BPS_CONFIGS, ROOT, load_shapes, make_grad  # noqa: E402

sys.path.insert(0, ROOT)
from bps_gc import compress  # noqa: E402
from bps_gc.ps.server.keys import KeyState  # noqa: E402
from bps_gc.comm.placement import DENSE_PARTITION_BYTES  # noqa: E402

PARTITION_BYTES = 4096000  # BYTEPS_PARTITION_BYTES's default
MIN_COMPRESS_BYTES = 65536
CONFIGS = ("onebit+EF", "thc 4-bit", "thc 4-bit+EF")


def keys_for(config, shapes, workers):
    """[(KeyState, [each worker's push])] of one round: the compressed tensors only (dense
    ones are summed alike whatever the codec)."""
    params = compress.CompressionParams.from_dict(BPS_CONFIGS[config])
    per = PARTITION_BYTES // 4
    out, key = [], 0
    phases = {0: [[] for _ in range(workers)], 1: [[] for _ in range(workers)]}
    for index, shape in enumerate(shapes):
        flat = [make_grad(shape, r, index).reshape(-1) for r in range(workers)]
        if flat[0].nbytes < MIN_COMPRESS_BYTES:
            continue
        for start in range(0, flat[0].size, per):
            n = min(per, flat[0].size - start)
            key += 1
            chains = [compress.build_chain(params, n, np.float32, key=key) for _ in range(workers)]
            pieces = [x[start:start + n] for x in flat]
            if params.compressor != "thc":
                decl = {"n": n, "name": f"t{key}", "params": params.to_dict()}
                state = KeyState(key, decl, np.float32, workers, compress, False)
                out.append((state, [c.compress(p, {"lr": 0.1}) for c, p in zip(chains, pieces)]))
                continue
            for c in chains:
                c.set_summands(workers)
            hists = [c.compress(p, {"step": 0}) for c, p in zip(chains, pieces)]
            hist = np.sum([h.view(chains[0].phase_dtype) for h in hists], axis=0).view(np.uint8)
            for r, c in enumerate(chains):
                phases[0][r].append(hists[r])
                phases[1][r].append(c.compress_q(hist))
    for phase in phases.values():  # each phase one dense tensor, cut into dense partitions
        if not phase[0]:
            continue
        buffers = [np.concatenate(p) for p in phase]
        for start in range(0, buffers[0].size, DENSE_PARTITION_BYTES):
            key += 1
            pushes = [b[start:start + DENSE_PARTITION_BYTES] for b in buffers]
            decl = {"n": pushes[0].size // 8, "name": f"phase{key}"}
            out.append((KeyState(key, decl, np.float64, workers, compress, False), pushes))
    return out


def server_round(keys, round_):
    """Thread CPU seconds of the server computing every key's result for one round."""
    for state, pushes in keys:
        for r, push in enumerate(pushes):
            state.buffers[r], state.lengths[r], state.via_shm[r] = push, push.size, False
    start = time.thread_time()
    for state, _ in keys:
        state.compute(round_, list(range(state.workers)))
    return time.thread_time() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="pushes per key (N)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tensors", type=int, default=0, help="only the first N tensors (0: all)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    shapes = load_shapes(args.tensors)
    results = {}
    for config in CONFIGS:
        keys = keys_for(config, shapes, args.workers)
        server_round(keys, 0)  # warm-up: buffers allocated
        results[config] = statistics.median(server_round(keys, r + 1) for r in range(args.rounds))
    base = results["onebit+EF"]
    print(f"server CPU per round, {args.workers} pushes per key, {len(shapes)} ResNet-50 tensors "
          f"(the compressed ones), median of {args.rounds} rounds")
    for config, seconds in results.items():
        print(f"{config:12} {seconds:8.4f} s   {seconds / base:5.2f}x onebit+EF")
    if args.json:
        json.dump({"workers": args.workers, "rounds": args.rounds, "seconds": results}, open(args.json, "w"))


if __name__ == "__main__":
    main()
