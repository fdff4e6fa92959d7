#!/usr/bin/env python3
"""One training step of the LM (example/pytorch/lm: forward, backward, AdamW) on one CPU thread,
at a few model sizes, in float32 and, where this CPU computes bf16 natively (train.py's
--precision auto), under bf16 autocast: the median of --steps timed steps after --warmup,
the rows taking turns (timed); a table and JSON (--out).

Each row uses the attention train.py would (gpt.attention_for). At the default size the
formulations it did not pick follow, marked "(not picked)": SDPA (its CPU flash kernel), SDPA
held to its math backend, and the plain matrix products: the evidence for attention_for.

    python scripts/lm_step_time.py
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, machine_info  # noqa: E402

sys.path[:0] = [os.path.join(ROOT, "example", "pytorch", "lm"), os.path.join(ROOT, "example", "pytorch")]
DEFAULT = "default (4 x 144, context 128)"
SIZES = {DEFAULT: (4, 144, 4, 128), "3 x 96, context 128": (3, 96, 4, 128),
         "reduced (2 x 64, context 64)": (2, 64, 4, 64)}
# the attention formulations timed: (GPT's attention, SDPA backend held to or None)
FORMULATIONS = {"sdpa": ("sdpa", None), "sdpa math backend": ("sdpa", "MATH"), "plain": ("plain", None)}


def stepper(torch, size, dtype, formulation, batch_size):
    """(parameters, step()): one training step of the GPT of ``size`` under autocast ``dtype``."""
    from gpt import GPT, byte_loss, parameter_count
    layers, width, heads, context = SIZES[size]
    attention, backend = FORMULATIONS[formulation]
    torch.manual_seed(0)
    model = GPT(layers, width, heads, context, attention)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (batch_size, context + 1), generator=torch.Generator().manual_seed(0))

    def step():
        held = contextlib.nullcontext()
        if backend:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            held = sdpa_kernel(getattr(SDPBackend, backend))
        with held:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = byte_loss(model(x[:, :-1]), x[:, 1:])
            loss.backward()
            opt.step()
    return parameter_count(model), step


def timed(steppers, args):
    """Each stepper's step times, the rows taking turns in blocks of --block steps (the first of
    a block untimed, to warm the caches again), so that a change in the box's load falls on
    every row alike."""
    times = [[] for _ in steppers]
    for _ in range(args.warmup):
        for step in steppers:
            step()
    while len(times[0]) < args.steps:
        for step, mine in zip(steppers, times):
            step()
            for _ in range(min(args.block, args.steps - len(mine))):
                began = time.perf_counter()
                step()
                mine.append(time.perf_counter() - began)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block", type=int, default=5, help="timed steps of a row before the next row's turn")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "lm_step_time.json"))
    args = p.parse_args()
    if min(args.steps, args.block, args.batch_size) < 1 or args.warmup < 0:
        p.error("--steps, --block and --batch-size must be >= 1, --warmup >= 0")
    import torch
    from gpt import attention_for
    from torch_device import pick_precision
    torch.set_num_threads(1)
    bf16, precision_line = pick_precision("auto", torch.device("cpu"))
    precisions = {"fp32": None, **({"bf16": torch.bfloat16} if bf16 else {})}
    runs = [(size, name, attention_for("cpu", dtype), True) for size in SIZES for name, dtype in precisions.items()]
    runs += [(DEFAULT, name, formulation, False) for name, dtype in precisions.items() for formulation in FORMULATIONS
             if FORMULATIONS[formulation][0] != attention_for("cpu", dtype) or FORMULATIONS[formulation][1]]
    print(f"{machine_info()}; one thread; batch {args.batch_size}; median of {args.steps} steps, the rows "
          f"taking turns in blocks of {args.block}")
    print(f"{precision_line}{'' if bf16 else ': no bf16 rows'}")
    print(f"{'size':32} {'parameters':>10} {'precision':9} {'attention':30} {'ms/step':>8}")
    made = [stepper(torch, size, precisions[precision], formulation, args.batch_size)
            for size, precision, formulation, _ in runs]
    rows = []
    per_row = timed([step for _, step in made], args)
    for (size, precision, formulation, picked), (parameters, _), times in zip(runs, made, per_row):
        ms = 1000 * statistics.median(times)
        rows.append({"size": size, "shape": dict(zip(("layers", "width", "heads", "context"), SIZES[size])),
                     "parameters": parameters, "precision": precision, "attention": formulation, "picked": picked,
                     "ms_per_step": ms})
        print(f"{size:32} {parameters:>10,} {precision:9} {formulation + ('' if picked else ' (not picked)'):30} "
              f"{ms:8.1f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    json.dump({"machine": machine_info(), "precision_auto": precision_line, "batch_size": args.batch_size,
               "steps": args.steps, "block": args.block, "rows": rows}, open(args.out, "w"), indent=1)
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
