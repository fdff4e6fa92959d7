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
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path[:0] = [ROOT, TESTS]
from fsdp_bytes import CODECS, table  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        spec = os.path.join(out, "spec.json")
        with open(spec, "w") as f:
            json.dump({"mode": "hooked", "steps": args.steps, "bytes": CODECS}, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS]), OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                               os.path.join(TESTS, "fsdp_job.py"), spec, out], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"fsdp_job.py failed:\n{done.stderr[-4000:]}")
        ranks = [dict(np.load(os.path.join(out, f"rank{r}.npz"))) for r in range(4)]
    print("\n".join(table(ranks[0])))
    if args.json:
        counts = [{k: float(v) for k, v in arrays.items() if k.startswith("bytes/")} for arrays in ranks]
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "codecs": CODECS, "ranks": counts}, f, indent=1)


if __name__ == "__main__":
    main()
