#!/usr/bin/env python3
"""register_fsdp_hooks(model, None, ...) on the parameter server: each rank's cross-host bytes
per step per codec, against the dense push's (native HSDP's all-reduce hands the wire as
many), the codec state a rank saves per byte of its parameter shard (its own chains'; and
the servers' of its shards), and whether the replicas of every shard stayed bit-identical: one ``bpslaunch --local``
of tests/fsdp_ps_job.py, 2 hosts x 2 local ranks, one server, the wider MLP (128-256-256-128,
float32) trained --steps SGD steps once per codec. Prints rank 0's table (every rank holds
shards of the same sizes) and writes every rank's counts as JSON (--json). The in-host rows
compress FSDP2's reduce-scatter inside the host too (shard_compression_params): their
``host pushed`` and ``host pulled`` are metrics()' in_host_* bytes, ``host state`` the in-host
codec state a rank saves per byte of its shard; the other rows leave it to FSDP2's own gloo
reduce-scatter, which bps_gc does not count ("-"; a ring's bytes are printed below the table).

    python scripts/fsdp_ps_bytes.py --json fsdp_ps_bytes.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from bench_common import pythonpath

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
CODECS = {"dense": None, "thc 4-bit": {"compressor": "thc", "bits": 4},
          "onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
          "onebit recipe": {"compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov",
                            "mu": 0.9},
          "PowerSGD r4": {"compressor": "powersgd", "rank": 4},
          "topk 1%+EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"}}
# run -> (its cross-host codec, its in-host one: shard_compression_params)
IN_HOST = {"in-host topk": (CODECS["topk 1%+EF"], CODECS["topk 1%+EF"])}
LOCAL = 2  # local ranks: the shard group's size


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        spec = os.path.join(out, "spec.json")
        with open(spec, "w") as f:
            json.dump({"steps": args.steps, "widths": [128, 256, 256, 128],
                       "runs": {**CODECS, **{run: across for run, (across, _) in IN_HOST.items()}},
                       "in_host": {run: inside for run, (_, inside) in IN_HOST.items()}}, f)
        env = dict(os.environ, PYTHONPATH=pythonpath(ROOT, TESTS), OMP_NUM_THREADS="1",
                   BYTEPS_MIN_COMPRESS_BYTES="0")
        done = subprocess.run([sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", "2", "--servers",
                               "1", "--local-size", str(LOCAL), "--", sys.executable, os.path.join(TESTS, "fsdp_ps_job.py"),
                               spec, out], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"fsdp_ps_job.py failed:\n{done.stdout[-4000:]}")
        ranks = [dict(np.load(os.path.join(out, f"rank{r}.npz"))) for r in range(2 * LOCAL)]
    counts = [{run: run_counts(r, run, args.steps) for run in [*CODECS, *IN_HOST]} for r in ranks]
    dense = counts[0]["dense"]["pushed_per_step"]
    print(f"{'codec':14} {'pushed B/step':>13} {'pulled B/step':>13} {'dense/it':>9} {'state/shard':>11} "
          f"{'servers/shard':>13} {'host pushed':>11} {'host pulled':>11} {'host state':>10} replicas")
    for run in [*CODECS, *IN_HOST]:
        same = all(ranks[i][k].tobytes() == ranks[LOCAL + i][k].tobytes() for i in range(LOCAL)
                   for k in ranks[i] if k.startswith(f"{run}/local/"))
        c = counts[0][run]
        host = [f"{c[k]:.0f}" if run in IN_HOST else "-" for k in ("host_pushed_per_step", "host_pulled_per_step")]
        host_state = f"{c['in_host_state'] / c['shard']:.3f}" if run in IN_HOST else "-"
        print(f"{run:14} {c['pushed_per_step']:13.0f} {c['pulled_per_step']:13.0f} "
              f"{dense / c['pushed_per_step']:9.2f} {c['worker_state'] / c['shard']:11.3f} "
              f"{c['server_state'] / c['shard']:13.3f} {host[0]:>11} {host[1]:>11} {host_state:>10} "
              f"{'bit-identical' if same else 'DIFFER'}")
    # FSDP2's own reduce-scatter, a ring: (S - 1) / S of its input (S padded shards) per rank
    print(f"(a ring reduce-scatter in the host: {(LOCAL - 1) * dense:.0f} B/step per rank each way, the "
          f"reduce dtype's {LOCAL - 1}/{LOCAL} of the {LOCAL} padded shards it takes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "ranks": counts}, f, indent=1)


def run_counts(arrays, run, steps):
    """One rank's counts of ``run`` (its bytes per step, its saved codec state, its shard's bytes)."""
    counted = {"pushed_per_step": int(arrays[f"{run}/pushed_wire"]) / steps,
               "pulled_per_step": int(arrays[f"{run}/pulled_wire"]) / steps,
               "worker_state": int(arrays[f"{run}/state_worker"]), "server_state": int(arrays[f"{run}/state_server"]),
               "shard": sum(v.nbytes for k, v in arrays.items() if k.startswith(f"{run}/local/0/"))}
    if f"{run}/state_in_host" in arrays:  # the in-host step's (shard_compression_params)
        counted.update({"host_pushed_per_step": int(arrays[f"{run}/in_host_pushed_wire"]) / steps,
                        "host_pulled_per_step": int(arrays[f"{run}/in_host_pulled_wire"]) / steps,
                        "host_raw_per_step": int(arrays[f"{run}/in_host_pushed_raw"]) / steps,
                        "in_host_state": int(arrays[f"{run}/state_in_host"])})
    return counted


if __name__ == "__main__":
    main()
