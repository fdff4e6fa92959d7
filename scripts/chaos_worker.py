"""A worker host of the elastic chaos loop (scripts/chaos_elastic.py): parameters updated in
place by each step's mean (p -= lr * mean), until the step named in the stop file. Each step
prints ``STEP step size epoch`` (the loop picks its kill moments from these) and keeps
bps.size(), bps.membership_epoch() and a CRC of the parameters' bytes, so hosts can be
compared step by step without saving every step's arrays. A joiner (a fresh process with a
dead host's DMLC_WORKER_ID) starts at the step elastic_start returns.

    python scripts/chaos_worker.py SPEC.json OUT_DIR
"""
import json
import os
import sys
import time
import zlib

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import bps_gc.core as bps  # noqa: E402
from elastic_host import say, start_host  # noqa: E402
from reference import gradient, step_ctx  # noqa: E402


def stop_step(path):
    """The last step every host runs, once the loop wrote it (atomically: a rename)."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def main(spec_path, out_dir):
    spec = json.load(open(spec_path))
    tensors = spec["tensors"]
    rank, params, start = start_host(spec)
    kept = {"sizes": [], "epochs": [], "crcs": []}
    step, last = start, None
    while last is None or step <= last:
        ctx = step_ctx(dict(spec, lrs=[0.1] * (step + 1)), step)
        handles = [(t["name"], bps.push_pull(gradient(rank, step, t), t["name"], ctx=ctx)) for t in tensors]
        for name, h in handles:
            params[name] -= np.float32(spec["lr"]) * h.wait()
        kept["sizes"].append(bps.size())
        kept["epochs"].append(bps.membership_epoch())
        kept["crcs"].append(zlib.crc32(b"".join(p.tobytes() for p in params.values())))
        say(f"STEP {step} {bps.size()} {bps.membership_epoch()}")
        last = stop_step(spec["stop_file"]) if last is None else last
        if last is not None and last < step:
            sys.exit(f"worker {rank} read the stop step {last} at step {step}, past it")
        step += 1
        time.sleep(spec["sleep"])
    np.savez(os.path.join(out_dir, f"rank{rank}.{start}.npz"), start=start,
             **{k: np.array(v, np.int64) for k, v in kept.items()}, **{f"param.{k}": v for k, v in params.items()})
    say(f"DONE {step - 1}")
    bps.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
