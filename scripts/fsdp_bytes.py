#!/usr/bin/env python3
"""register_fsdp_hooks' cross-host bytes per step and codec memory per rank, against native
HSDP's, per codec (tests/fsdp_bytes.py: CODECS, and what each column counts): one torchrun of
tests/fsdp_job.py, 4 gloo ranks on a (2 replicas, 2 shards) mesh, the job's wider MLP
(fsdp_job.WIDE, float32) trained --steps SGD steps once per codec. Prints rank 0's table (every
rank holds shards of the same sizes) and writes every rank's counts as JSON (--json).

    python scripts/fsdp_bytes.py --json fsdp_bytes.json
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path[:0] = [ROOT, TESTS]
from fsdp_bytes import CODECS, run_fsdp_job, table  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ranks = run_fsdp_job({"mode": "hooked", "steps": args.steps, "bytes": CODECS})
    print("\n".join(table(ranks[0])))
    if args.json:
        counts = [{k: float(v) for k, v in arrays.items() if k.startswith("bytes/")} for arrays in ranks]
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "codecs": CODECS, "ranks": counts}, f, indent=1)


if __name__ == "__main__":
    main()
