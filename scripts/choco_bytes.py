#!/usr/bin/env python3
"""Bytes of one CHOCO-SGD / D-PSGD gossip message (what a worker sends each neighbour per step)
for the CIFAR-10 ResNet-20 of example/pytorch/train_cifar10_choco.py, per Q, beside the
published figures of algorithms.md section 5 (ring of 8).

The message is bps_gc's (bps_gc.algorithms.gossip.pack): uint32 count, uint32 lengths, then each
tensor's payload from its codec chain. Sizes do not depend on the values but for qsgd's
variable-length codes (input: N(0, 1e-3) floats, seed 0).

    python scripts/choco_bytes.py [--json out/choco_bytes.json]
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "example", "pytorch")]
from bps_gc.algorithms.gossip import codec_for, gossip_params, pack  # noqa: E402

# Q name -> (compression_params or None for the float model itself, the published MB)
QS = {
    "none (D-PSGD)": (None, 1.04),
    "signnorm": ({"compressor": "signnorm"}, 0.032),
    "top-1%": ({"compressor": "topk", "k": 0.01}, None),
    "random-1%": ({"compressor": "randomk", "k": 0.01}, None),
    "qsgd, 4 levels": ({"compressor": "qsgd", "levels": 4}, None),
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=os.path.join("out", "choco_bytes.json"))
    args = p.parse_args()
    from train_cifar100_byteps_gc import resnet
    shapes = [tuple(t.shape) for t in resnet("resnet20", classes=10).parameters()]
    rng = np.random.default_rng(0)
    values = [rng.normal(0, 1e-3, int(np.prod(s))).astype(np.float32) for s in shapes]
    dense = sum(v.nbytes for v in values)
    print(f"CIFAR-10 ResNet-20: {len(shapes)} tensors, {sum(v.size for v in values):,} parameters, "
          f"{dense:,} B as float32")
    print(f"{'Q':<16} {'bytes/neighbour/step':>21} {'x less':>7} {'published MB':>13}")
    rows = []
    for name, (params, published) in QS.items():
        params = gossip_params(params) if params else None
        payloads = [codec_for(params, v.size, np.float32, key).compress(v, {"lr": 0.0})
                    for key, v in enumerate(values)]
        size = int(pack(payloads).size)
        rows.append({"q": name, "bytes": size, "published_mb": published})
        print(f"{name:<16} {size:>21,} {dense / size:>7.1f} {published if published else '-':>13}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"tensors": len(shapes), "dense_bytes": dense, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
