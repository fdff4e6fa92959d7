#!/usr/bin/env python3
"""One training step of the LM (example/pytorch/lm: forward, backward, AdamW) on one CPU thread,
at a few model sizes: the median of --steps timed steps after --warmup, per size; a table and
JSON (--out).

    python scripts/lm_step_time.py
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, machine_info  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "example", "pytorch", "lm"))
SIZES = {"default (4 x 144, context 128)": (4, 144, 4, 128), "3 x 96, context 128": (3, 96, 4, 128),
         "reduced (2 x 64, context 64)": (2, 64, 4, 64)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "lm_step_time.json"))
    args = p.parse_args()
    import numpy as np
    import torch
    from gpt import GPT, byte_loss, parameter_count
    torch.set_num_threads(1)
    rows = {}
    print(f"{machine_info()}; one thread; batch {args.batch_size}; median of {args.steps} steps")
    for name, (layers, width, heads, context) in SIZES.items():
        torch.manual_seed(0)
        model = GPT(layers, width, heads, context)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (args.batch_size, context + 1), generator=torch.Generator().manual_seed(0))
        times = []
        for step in range(args.warmup + args.steps):
            began = time.perf_counter()
            opt.zero_grad()
            byte_loss(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            times.append(time.perf_counter() - began)
        ms = 1000 * float(np.median(times[args.warmup:]))
        rows[name] = {"parameters": parameter_count(model), "ms_per_step": ms}
        print(f"{name:32} {parameter_count(model):>10,} parameters {ms:8.1f} ms/step")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    json.dump({"machine": machine_info(), "batch_size": args.batch_size, "rows": rows}, open(args.out, "w"), indent=1)
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
