#!/usr/bin/env python3
"""What a parameter server's keys hold between rounds, per codec: the keys' reducers sharing the
server's scratch (a sum and a decoded push per engine thread, the largest key's size: the
server's default) beside each keeping its own (before), in one run. One server holding every
partition of ResNet-50's gradients (tests/data/resnet50_shapes.json, v1b, split as the workers split
them: at most BYTEPS_PARTITION_BYTES, 4,096,000, a partition), 2 workers' compressed pushes for
--rounds rounds, in this process, as the server's engine runs its keys (ps/server/keys.py).

    python scripts/server_key_memory.py --json out/server_key_memory.json

``held/g``: every array reachable from the keys' reducers, each once, over the gradients'
bytes; ``s/round``: the engine's work a round (every key's reduce), the median of the rounds.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
from bps_gc import compress  # noqa: E402
from bps_gc.ps.server.keys import KeyState  # noqa: E402
from bps_gc.wire.wire import COMPRESSED_BIT, Header, Msg  # noqa: E402
from bench_common import machine_info  # noqa: E402
from held_bytes import held_bytes  # noqa: E402

CODECS = {"onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          "topk 1%+EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"},
          "dithering 4": {"compressor": "dithering", "k": 4}}
MODES = ("own buffers", "shared scratch")


def partitions(shapes, limit_bytes):
    """Each gradient split into near-equal partitions of at most ``limit_bytes`` float32s."""
    sizes = []
    for shape in shapes:
        n = math.prod(shape)
        parts = -(-n * 4 // limit_bytes)
        sizes += [n // parts + (i < n % parts) for i in range(parts)]
    return sizes


def one_row(params, sizes, scratch, rounds):
    keys, workers = [], []
    for key, n in enumerate(sizes):
        decl = {"name": f"p{key}", "n": n, "params": params, "reducer": "recompress"}
        state = KeyState(key, decl, np.float32, 2, compress, False, scratch=scratch)
        state.declared.update((0, 1))
        keys.append(state)
        workers.append([compress.build_chain(params, n, np.float32, key=key, rank=r) for r in range(2)])
    rng, times = np.random.default_rng(0), []
    for number in range(rounds):
        pushes = [[w.compress(rng.standard_normal(state.n, np.float32), {"lr": 0.1}) for w in pair]
                  for state, pair in zip(keys, workers)]
        start = time.process_time()
        for state, payloads in zip(keys, pushes):
            for rank, payload in enumerate(payloads):
                header = Header(Msg.PUSH, rank, key=state.key, length=payload.nbytes, dtype=np.dtype(np.float32),
                                flags=COMPRESSED_BIT, round=number, ctx={"lr": 0.1})
                np.frombuffer(state.buffer_for(rank, header), np.uint8)[:] = payload
                state.arrive(rank, None, header)
            job = state.take_round()
            state.compute(job.number, job.ranks)
        times.append(time.process_time() - start)
    return {"grads": 4 * sum(sizes), "held": held_bytes([state.reducer for state in keys]),
            "s_round": statistics.median(times)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with open(os.path.join(ROOT, "tests", "data", "resnet50_shapes.json")) as f:
        sizes = partitions(json.load(f)["resnet50_v1b"], 4_096_000)
    print(f"{machine_info()}; {len(sizes)} partitions of ResNet-50's gradients, the largest {max(sizes):,} floats;"
          f" load average {os.getloadavg()[0]:.2f} at the start")
    rows = {}
    for name, params in CODECS.items():
        for mode in MODES:
            scratch = compress.Scratch(kept=True) if mode == "shared scratch" else None
            rows[f"{name} | {mode}"] = one_row(params, sizes, scratch, args.rounds)
    print(f"{'codec | buffers':30} {'grads B':>12} {'held/g':>7} {'s/round':>8}")
    for label, row in rows.items():
        print(f"{label:30} {row['grads']:>12,} {row['held'] / row['grads']:>7.3f} {row['s_round']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"box": machine_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
