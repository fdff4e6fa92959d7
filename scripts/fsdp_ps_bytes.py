#!/usr/bin/env python3
"""register_fsdp_hooks(model, None, ...) on the parameter server: each rank's cross-host bytes
per step per codec, against the dense push's (native HSDP's all-reduce hands the wire as
many), the codec state a rank saves per byte of its parameter shard (its own chains'; and
the servers' of its shards), and whether the replicas of every shard stayed bit-identical: one ``bpslaunch --local``
of tests/fsdp_ps_job.py, 2 hosts x 2 local ranks, one server, the wider MLP (128-256-256-128,
float32) trained --steps SGD steps once per codec. Prints rank 0's table (every rank holds
shards of the same sizes) and writes every rank's counts as JSON (--json).

    python scripts/fsdp_ps_bytes.py --json fsdp_ps_bytes.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
CODECS = {"dense": None, "thc 4-bit": {"compressor": "thc", "bits": 4},
          "onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          "onebit recipe": {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov",
                            "mu": 0.9},
          "PowerSGD r4": {"compressor": "powersgd", "rank": 4},
          "topk 1%+EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        spec = os.path.join(out, "spec.json")
        with open(spec, "w") as f:
            json.dump({"steps": args.steps, "widths": [128, 256, 256, 128], "runs": CODECS}, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]), OMP_NUM_THREADS="1",
                   BYTEPS_MIN_COMPRESS_BYTES="0")
        done = subprocess.run([sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", "2", "--servers",
                               "1", "--local-size", "2", "--", sys.executable, os.path.join(TESTS, "fsdp_ps_job.py"),
                               spec, out], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"fsdp_ps_job.py failed:\n{done.stdout[-4000:]}")
        ranks = [dict(np.load(os.path.join(out, f"rank{r}.npz"))) for r in range(4)]
    counts = [{run: {"pushed_per_step": int(r[f"{run}/pushed_wire"]) / args.steps,
                     "pulled_per_step": int(r[f"{run}/pulled_wire"]) / args.steps,
                     "worker_state": int(r[f"{run}/state_worker"]), "server_state": int(r[f"{run}/state_server"]),
                     "shard": sum(v.nbytes for k, v in r.items() if k.startswith(f"{run}/local/0/"))}
               for run in CODECS} for r in ranks]
    dense = counts[0]["dense"]["pushed_per_step"]
    print(f"{'codec':14} {'pushed B/step':>13} {'pulled B/step':>13} {'dense/it':>9} {'state/shard':>11} "
          f"{'servers/shard':>13} replicas")
    for run in CODECS:
        same = all(ranks[i][k].tobytes() == ranks[2 + i][k].tobytes() for i in range(2)
                   for k in ranks[i] if k.startswith(f"{run}/local/"))
        c = counts[0][run]
        print(f"{run:14} {c['pushed_per_step']:13.0f} {c['pulled_per_step']:13.0f} "
              f"{dense / c['pushed_per_step']:9.2f} {c['worker_state'] / c['shard']:11.3f} "
              f"{c['server_state'] / c['shard']:13.3f} {'bit-identical' if same else 'DIFFER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "ranks": counts}, f, indent=1)


if __name__ == "__main__":
    main()
