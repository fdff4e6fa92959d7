#!/usr/bin/env python3
"""Writes tests/data/byteps_steps/: BytePS 0.2.5.post15's own chains over STEPS steps of a
seeded gradient stream, every step's payload and decoding (see README.md beside this file).

    python scripts/byteps_ref/multistep.py [--n 4096] [--steps 10] [--out tests/data/byteps_steps]

reference.py builds multistep.cc with the sdist's compressor sources. The build turns off
floating-point contraction (-ffp-contract=off): BytePS's own -march=native build fuses
``a + alpha * b`` in CpuReducer::sum into one multiply-add where the CPU has FMA, which rounds
once where bps_gc (numpy's order) rounds twice; see docs/codecs.md. ``--fma`` builds it as
BytePS does instead and only reports, per case, the first step whose bytes differ.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference  # noqa: E402  (beside this file)

ROOT = os.path.dirname(os.path.dirname(HERE))
SEED = 34  # of the gradient streams (numpy's PCG64)
NO_FMA = reference.CXXFLAGS + " -ffp-contract=off"
EF = {"ef": "vanilla"}
NESTEROV = {"momentum": "nesterov", "mu": 0.9}


def cases(n):
    """(name in multistep.cc, bps_gc's params, server case) in multistep.cc's order."""
    k = n // 100
    onebit_s = {"compressor": "onebit", "scaling": True}
    onebit = {"compressor": "onebit", "scaling": False}
    topk = {"compressor": "topk", "k": k}
    randomk = {"compressor": "randomk", "k": k, "seed": 2020}
    dith_nat = {"compressor": "dithering", "k": 2, "partition": "natural", "normalize": "max",
                "seed": 2020}
    dith_lin = dict(dith_nat, partition="linear")
    return [
        ("ef_onebit_scaling", {**onebit_s, **EF}, False),
        ("ef_onebit", {**onebit, **EF}, False),
        ("ef_topk_1", {**topk, **EF}, False),
        ("ef_randomk_1", {**randomk, **EF}, False),
        ("ef_dithering_2_natural", {**dith_nat, **EF}, False),
        ("nesterov_ef_onebit_scaling", {**onebit_s, **EF, **NESTEROV}, False),
        ("nesterov_ef_topk_1", {**topk, **EF, **NESTEROV}, False),
        ("nesterov_onebit_scaling", {**onebit_s, **NESTEROV}, False),
        ("randomk_1", randomk, False),
        ("dithering_2_linear", dith_lin, False),
        ("server_nesterov_ef_onebit_scaling", {**onebit_s, **EF, **NESTEROV}, True),
        ("server_onebit_scaling", onebit_s, True),
        ("server_ef_topk_1", {**topk, **EF}, True),
        ("server_ef_randomk_1", {**randomk, **EF}, True),
        ("server_ef_dithering_2_natural", {**dith_nat, **EF}, True),
    ]


def streams(n, steps):
    """Two workers' gradient streams, float32 [2, steps, n]; the scale varies by step."""
    rng = np.random.default_rng(SEED)
    scale = np.float32(1e-2) * (1 + np.arange(steps, dtype=np.float32) % 3)
    return (rng.standard_normal((2, steps, n), np.float32) * scale[None, :, None]).astype("<f4")


def run_reference(n, steps, cxxflags):
    """{case: (payloads, decodings)} from BytePS's chains, one entry per step."""
    binary = reference.build("multistep.cc", cxxflags)
    grads = streams(n, steps)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for w in range(2):
            for s in range(steps):
                grads[w, s].tofile(os.path.join(tmp, f"w{w}.{s}.f32"))
        r = subprocess.run([binary, str(n), str(steps), tmp], cwd=tmp, capture_output=True,
                           text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
        if r.returncode != 0:
            sys.exit(f"{binary} exited {r.returncode}: {r.stderr.strip()[-300:]}")
        for name, _, _ in cases(n):
            read = lambda s, ext, dt: np.fromfile(os.path.join(tmp, f"{name}.{s}.{ext}"), dt)
            out[name] = ([read(s, "comp", np.uint8) for s in range(steps)],
                         [read(s, "decomp", "<f4") for s in range(steps)])
    return grads, out


def write(out_dir, n, steps, grads, results):
    os.makedirs(out_dir, exist_ok=True)
    np.save(os.path.join(out_dir, "gradients.npy"), grads)
    manifest = {
        "source": f"BytePS {reference.VERSION} ({reference.SDIST}, sha256 {reference.SDIST_SHA256})",
        "command": "python scripts/byteps_ref/multistep.py",
        "build": NO_FMA, "n": n, "steps": steps, "lr": 0.1, "gradients": "gradients.npy",
        "gradients_note": "float32 [worker, step, n]; worker cases use worker 0's stream",
        "cases": []}
    for name, params, server in cases(n):
        payloads, decodings = results[name]
        arrays = {f"payload{s}": p for s, p in enumerate(payloads)}
        arrays.update({f"decoded{s}": d for s, d in enumerate(decodings)})
        np.savez_compressed(os.path.join(out_dir, f"{name}.npz"), **arrays)
        manifest["cases"].append({"name": name, "params": params, "server": server,
                                  "file": f"{name}.npz"})
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


def first_differences(a, b):
    """{case: first step whose payload bytes differ} between two runs' results."""
    diff = {}
    for name in a:
        for s, (x, y) in enumerate(zip(a[name][0], b[name][0])):
            if x.tobytes() != y.tobytes():
                diff[name] = s
                break
    return diff


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="float32 elements per tensor")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "byteps_steps"))
    ap.add_argument("--fma", action="store_true",
                    help="compare BytePS's FMA build against the vectors' build; write nothing")
    args = ap.parse_args(argv)
    try:
        grads, results = run_reference(args.n, args.steps, NO_FMA)
        if args.fma:
            _, fused = run_reference(args.n, args.steps, reference.CXXFLAGS)
            diff = first_differences(results, fused)
            for name, _, _ in cases(args.n):
                print(f"{name:36s} {'first differs at step %d' % diff[name] if name in diff else 'same bytes'}")
            return
    except reference.Unavailable as e:
        sys.exit(f"BytePS reference not built: {e}")
    write(args.out, args.n, args.steps, grads, results)
    print(f"wrote {len(results)} cases x {args.steps} steps to {args.out}")


if __name__ == "__main__":
    main()
