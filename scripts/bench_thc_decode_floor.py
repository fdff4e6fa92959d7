#!/usr/bin/env python3
"""thc's decode beside the memory traffic it cannot avoid (issue 44's "thc fast enough to hide").

thc's finish writes out (4 bytes an element, as onebit's decode does) and reads the summed words
(0.67 bytes an element for 4-bit codes of 2 pushes in int64 words, 0.8 in float64 words, against
onebit's 0.125); for float64 words it reads them once more first, to refuse a bad sum before out
is written. This script times, in interleaved rounds of one process, EF + onebit's decode and
thc's finish (as bench_codecs.py calls them) beside loops that only move those bytes, with no
arithmetic: 64-byte stores of out (prefetched for writing, like the codecs' kernels), the same
stores reading a 64-byte line of words every 6 (int64) or 5 (float64) stores, and for float64
one read of the words before that. Where a loop that only moves thc's bytes is slower than
onebit's decode, no thc decoder that writes out with ordinary stores can reach onebit's GB/s.

    python scripts/bench_thc_decode_floor.py                  # 1M and 4M elements, 5 rounds
    python scripts/bench_thc_decode_floor.py --sizes 1M --rounds 9

The loops are C, compiled here with $CC (default cc) for AVX-512; without AVX-512 it says so.
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bps_gc.compress import build_chain  # noqa: E402
from bench_codecs import median_seconds, parse_size, thc_sums  # noqa: E402

LOOPS = r"""
#include <immintrin.h>
#include <stdint.h>
#define AVX512 __attribute__((target("avx512f")))
/* out's 64-byte vectors stored; every `per` (5 or 6) of them one 64-byte line of words read (0: none) */
#define MOVE(PER) for (int64_t i = 0; i + 16 * (PER) <= n; i += 16 * (PER), w += 64) {             \
        if (READ) { __builtin_prefetch(w + 4096, 0, 3);                                          \
                    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(w)); }                        \
        __m512 v = _mm512_castsi512_ps(acc);                                                     \
        for (int u = 0; u < (PER); u++) {                                                        \
            __builtin_prefetch(out + i + 16 * u + 2048, 1, 3);                                    \
            _mm512_storeu_ps(out + i + 16 * u, v); } }
AVX512 void move_bytes(float *out, int64_t n, const char *w, int per) {
    __m512i acc = _mm512_setzero_si512();
    const int READ = per != 0;
    switch (per) { case 5: MOVE(5) break; case 6: MOVE(6) break; default: MOVE(6) }
}
/* every 64-byte line of `bytes` read (the float64 check's pass, without its arithmetic) */
AVX512 int64_t read_lines(const char *w, int64_t bytes) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t i = 0; i + 64 <= bytes; i += 64) {
        __builtin_prefetch(w + i + 4096, 0, 3);
        acc = _mm512_or_si512(acc, _mm512_loadu_si512(w + i));
    }
    return _mm512_reduce_or_epi64(acc);
}
"""


def build_loops():
    src = tempfile.NamedTemporaryFile("w", suffix=".c", delete=False)
    src.write(LOOPS)
    src.close()
    lib_path = src.name[:-2] + ".so"
    try:
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-shared", "-fPIC", "-o", lib_path, src.name],
                       check=True, capture_output=True, text=True)
        lib = ctypes.CDLL(lib_path)
    finally:
        os.unlink(src.name)
        if os.path.exists(lib_path):
            os.unlink(lib_path)
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.move_bytes.argtypes, lib.move_bytes.restype = [P, I, P, ctypes.c_int], None
    lib.read_lines.argtypes, lib.read_lines.restype = [P, I], I
    return lib


def thc_finish(x, out, carrier):
    """finish of two equal pushes' summed 4-bit codes (bench_codecs.py's thc_sums, as its
    time_thc times it); and the summed code words' bytes."""
    codec, _, _, _, code_sum = thc_sums({"compressor": "thc", "bits": 4}, carrier, x, summands=2)
    return (lambda: codec.finish(code_sum, out, 2)), code_sum.nbytes


def cases(lib, n, rng):
    x = rng.standard_normal(n, dtype=np.float32) * 1e-3
    out = np.empty_like(x)
    onebit = build_chain({"compressor": "onebit", "scaling": True, "ef": "vanilla"}, n, np.float32, key=1)
    payload = onebit.compress(x, {"lr": 0.1})
    f64, f64_bytes = thc_finish(x, out, np.float64)
    i64, i64_bytes = thc_finish(x, out, np.int64)
    words = np.ones(max(f64_bytes, i64_bytes) // 8 + 64, np.uint64)
    o, w = out.ctypes.data, words.ctypes.data
    return {
        "EF + onebit decode": lambda: onebit.decompress(payload, out),
        "thc 4-bit decode (float64 words)": f64,
        "thc 4-bit decode (int64 words)": i64,
        "floor: stores only": lambda: lib.move_bytes(o, n, w, 0),
        f"floor: stores + {i64_bytes / n:.2f} B/elem read": lambda: lib.move_bytes(o, n, w, 6),
        f"floor: stores + {f64_bytes / n:.2f} B/elem read": lambda: lib.move_bytes(o, n, w, 5),
        f"floor: {f64_bytes / n:.2f} B/elem read, then the same": lambda: (lib.read_lines(w, f64_bytes),
                                                                           lib.move_bytes(o, n, w, 5)),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,4M", help="comma-separated element counts, K/M suffix")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (every case once a round)")
    ap.add_argument("--repeats", type=int, default=15, help="timed calls per case and round, median taken")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be >= 1")
    with open("/proc/cpuinfo") as f:
        if "avx512f" not in f.read():
            sys.exit("bench_thc_decode_floor: the floor loops need AVX-512, which this CPU lacks")
    lib = build_loops()
    print(f"load average {os.getloadavg()[0]:.2f} at the start; {len(os.sched_getaffinity(0))} cores")
    rng = np.random.default_rng(0)
    for label in args.sizes.split(","):
        n = parse_size(label)
        fns = cases(lib, n, rng)
        gbps = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                gbps[name].append(n * 4 / 1e9 / median_seconds(fn, args.repeats))
        ref = gbps["EF + onebit decode"]
        print(f"\n{label} elements: GB/s of float32 out, median of {args.rounds} rounds (their range); "
              f"x onebit: the median of the rounds' ratios")
        for name, values in gbps.items():
            ratio = statistics.median(v / r for v, r in zip(values, ref))
            print(f"  {name:44s}{statistics.median(values):7.1f}  ({min(values):.1f}-{max(values):.1f})"
                  f"  {ratio:5.2f}x")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
