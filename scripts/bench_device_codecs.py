#!/usr/bin/env python3
"""Device chain throughput (issue 26): compress / decompress GB/s of uncompressed float32 input
for build_chain(..., device=...), beside "host copy + numpy chain" for the same tensor in the
same run (copy the tensor to the host, run the numpy chain, copy the payload back; decoding the
other way round), and the ratio between the two.

The ``path`` column says what ran: ``device`` (torch operations on the device) or ``bridge``
(a codec with no device implementation yet: the numpy chain behind HostBridge, so both columns
time the same work). Median of --repeats timed runs after one warm-up; on CUDA every timed
run ends with torch.cuda.synchronize(). scripts/bench_codecs.py takes its device rows from
``device_rows``.

    python scripts/bench_device_codecs.py --device cpu --sizes 1M
    python scripts/bench_device_codecs.py --device cuda --sizes 1M,25M --json out/bench_device_codecs.json
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bps_gc.compress import build_chain  # noqa: E402

CODECS = {
    "onebit scaling": {"compressor": "onebit", "scaling": True},
    "EF + onebit": {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
    "sign": {"compressor": "sign"},
    "signnorm": {"compressor": "signnorm"},
    "topk 0.1%": {"compressor": "topk", "k": 0.001},
    "topk 1%": {"compressor": "topk", "k": 0.01},
    "EF + topk 1%": {"compressor": "topk", "k": 0.01, "ef": "vanilla"},
    "nesterov + EF + topk 1%": {"compressor": "topk", "k": 0.01, "ef": "vanilla",
                                "momentum": "nesterov", "mu": 0.9},
    "threshold v=2e-3": {"compressor": "threshold", "threshold": 2e-3},
    "adaptive_threshold": {"compressor": "adaptive_threshold"},
    "randomk 1%": {"compressor": "randomk", "k": 0.01},
    "dithering k=2 linear": {"compressor": "dithering", "k": 2},
    "terngrad": {"compressor": "terngrad"},
    "qsgd Q=255": {"compressor": "qsgd", "levels": 255},
    "dgc 0.1% mu=0.9": {"compressor": "dgc", "k": 0.001, "mu": 0.9},
}


def parse_size(text):
    units = {"K": 10**3, "M": 10**6}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def median_seconds(fn, repeats, sync):
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def device_rows(device, sizes=("1M",), repeats=5, only=None):
    """One row per (codec, size): codec, size, n, device, path ("device" or "bridge"),
    compress/decompress GB/s of the device chain and of host copy + numpy chain, the device
    chain's speedup over it, and the compression ratio."""
    import torch
    from bps_gc.compress.device import HostBridge, host_array, resolve_device
    device = resolve_device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    names = [name for name in CODECS if not only or any(word in name for word in only)]
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for label in sizes:
        n = parse_size(label)
        x = torch.randn(n, generator=gen, device=device, dtype=torch.float32) * 1e-3
        out = torch.empty_like(x)
        gb = x.numel() * 4 / 1e9
        for name in names:
            params, ctx = CODECS[name], {"lr": 0.1}
            chain = build_chain(params, n, np.float32, key=1, device=device)
            host = build_chain(params, n, np.float32, key=1)
            tc = median_seconds(lambda: chain.compress(x, ctx), repeats, sync)
            payload = chain.compress(x, ctx)
            td = median_seconds(lambda: chain.decompress(payload, out), repeats, sync)

            def host_compress():
                return torch.from_numpy(host.compress(x.cpu().numpy(), ctx)).to(device)

            def host_decompress():
                out.copy_(torch.from_numpy(host.decompress(host_array(payload))))
            hc = median_seconds(host_compress, repeats, sync)
            hd = median_seconds(host_decompress, repeats, sync)
            rows.append({"codec": name, "size": label, "n": n, "device": str(device),
                         "path": "bridge" if isinstance(chain, HostBridge) else "device",
                         "compress_gbps": gb / tc, "decompress_gbps": gb / td,
                         "host_compress_gbps": gb / hc, "host_decompress_gbps": gb / hd,
                         "speedup": (hc / tc, hd / td),
                         "compression_ratio": x.numel() * 4 / max(payload.numel(), 1)})
    return rows


def table(rows):
    head = (f"{'codec':<25}{'size':>6}{'path':>8}{'comp GB/s':>11}{'decomp GB/s':>13}"
            f"{'host c/d GB/s':>17}{'x host c/d':>13}{'ratio':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        host = f"{r['host_compress_gbps']:.3g}/{r['host_decompress_gbps']:.3g}"
        speed = f"{r['speedup'][0]:.2f}/{r['speedup'][1]:.2f}"
        lines.append(f"{r['codec']:<25}{r['size']:>6}{r['path']:>8}{r['compress_gbps']:>11.2f}"
                     f"{r['decompress_gbps']:>13.2f}{host:>17}{speed:>13}{r['compression_ratio']:>8.1f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the tensors live")
    ap.add_argument("--sizes", default="1M,4M,25M", help="comma-separated element counts (K/M suffix)")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per case (median taken)")
    ap.add_argument("--only", default="", help="comma-separated words: just the codecs named with one")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1, like the single-threaded numpy chain)")
    ap.add_argument("--json", default="out/bench_device_codecs.json", help="where to write the results")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    try:
        import torch
    except ImportError:
        ap.error("the device chains need torch, which this Python cannot import")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False on this machine")
    torch.set_num_threads(args.threads)
    rows = device_rows(args.device, args.sizes.split(","), args.repeats,
                       [w for w in args.only.split(",") if w])
    print(table(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": args.device, "repeats": args.repeats, "threads": args.threads,
                   "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
