#!/usr/bin/env python3
"""register_fsdp_hooks' in-host step (shard_compression_params) against FSDP2's own
reduce-scatter, per codec: bytes a rank hands the in-host link per step and the seconds of
its reduce-scatters. One torchrun of tests/fsdp_job.py, 4 gloo ranks on a (2 replicas, 2
shards) mesh, the job's wider MLP (fsdp_job.WIDE, float32), dense across replicas, --steps SGD
steps per row. Prints rank 0's table and writes every rank's counts as JSON (--json).

    python scripts/fsdp_inhost_bytes.py --json fsdp_inhost.json

Columns: ``pushed``/``pulled``: what bps_gc.torch.metrics() counts (``in_host_pushed_wire``,
``in_host_pulled_wire``) per step; ``ring``: what a ring reduce-scatter of the same inputs
sends per rank, (S - 1) / S of its input (S: the shard group's size; FSDP2's own on gloo is not
counted by bps_gc, so this is the formula, not a measurement); ``ring/pushed``; ``wall ms`` and
``CPU ms``: the reduce-scatters' seconds per step on this rank, wall and the process's CPU (all
its threads: the codecs' work); ``state/shard``: the in-host codecs' saved state
(``bps_gc.torch.state_dict()``'s arrays) over the rank's parameter shard (float32)."""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path[:0] = [ROOT, TESTS]
from fsdp_bytes import run_fsdp_job  # noqa: E402
WIDE = [128, 256, 256, 128]  # fsdp_job.WIDE
SHARDS = 2
ROWS = {"native": None, "dense": {}, "topk 1%+EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"},
        "onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
        "thc 4-bit": {"compressor": "thc", "bits": 4, "feedback": True},
        "PowerSGD r4": {"compressor": "powersgd", "rank": 4}}


def table(arrays, steps):
    raw = 4 * sum(a * b + b for a, b in zip(WIDE, WIDE[1:]))  # a step's reduce-scatter inputs, float32
    ring = raw * (SHARDS - 1) // SHARDS
    lines = [f"{'codec':<13}{'pushed':>9}{'pulled':>9}{'ring':>9}{'ring/pushed':>12}{'wall ms':>9}{'CPU ms':>8}"
             f"{'state/shard':>12}"]
    for name in ROWS:
        pushed, pulled = (arrays[f"{name}/bytes/in_host_{k}_wire"] / steps for k in ("pushed", "pulled"))
        wall, cpu = arrays[f"{name}/rs_seconds"].sum(axis=0) * 1e3 / steps
        ratio = f"{ring / pushed:.2f}" if pushed else "-"
        state = arrays[f"{name}/bytes/in_host_state"] / arrays[f"{name}/bytes/shard"]
        lines.append(f"{name:<13}{pushed:>9.0f}{pulled:>9.0f}{ring:>9}{ratio:>12}{wall:>9.1f}{cpu:>8.1f}{state:>12.3f}")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    parts = {name: {"mode": "hooked", "steps": args.steps, "widths": WIDE, "record_rs": True,
                    **({} if params is None else {"shard_compression_params": params})}
             for name, params in ROWS.items()}
    ranks = run_fsdp_job({"mode": "parts", "parts": parts})
    print("\n".join(table(ranks[0], args.steps)))
    if args.json:
        counts = [{k: np.asarray(v).tolist() for k, v in arrays.items() if "bytes/" in k or "rs_seconds" in k}
                  for arrays in ranks]
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "rows": ROWS, "ranks": counts}, f, indent=1)


if __name__ == "__main__":
    main()
