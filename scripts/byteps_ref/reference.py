#!/usr/bin/env python3
"""BytePS 0.2.5.post15's own CPU codecs, built from its source distribution and timed here.

The side-by-side reference of scripts/bench_codecs.py (see README.md beside this file). The
sdist comes from PyPI through pip (or from BPS_GC_BYTEPS_SDIST: a .tar.gz or an unpacked
directory), is checked against its pinned sha256, and the compressor sources are compiled
unmodified with bench.cc and stubs/ into one binary, cached under $BPS_GC_CACHE_DIR (default
~/.cache/bps_gc) keyed by a hash of every source byte, the flags, the compiler and the CPU
(-march=native), so only the first run downloads and compiles (about 10 s).

    python scripts/byteps_ref/reference.py --sizes 1000000,25000000 --runs 7 --threads 1
"""
import argparse
import hashlib
import io
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.2.5.post15"
SDIST = f"byteps-{VERSION}.tar.gz"
SDIST_SHA256 = "9d6a3c5be4c4b5a172739744bb32725c433f9a9f63794e1885e7376ff4eea99f"
# The sdist's files the compressors need (paths under byteps/common/); its common.h is replaced
# by stubs/common.h because the real one pulls in CUDA, NCCL and Python.h.
UPSTREAM = ["logging.h", "logging.cc", "half.h", "cpu_reducer.h", "cpu_reducer.cc"] + [
    f"compressor/{f}" for f in (
        "common.h", "compressor.h", "utils.h", "compressor_registry.h", "compressor_registry.cc",
        "error_feedback.h", "error_feedback.cc", "momentum.h", "momentum.cc")] + [
    f"compressor/impl/{name}.{ext}" for name in (
        "onebit", "topk", "randomk", "dithering", "vanilla_error_feedback", "nesterov_momentum")
    for ext in ("h", "cc")]
STUBS = ["stubs/common.h", "stubs/common_stub.cc"]
# As BytePS's setup.py builds them (-march=native -mno-avx512f; compressor/common.h defines
# half_t only under __F16C__), server variant: Decompress writes into the compressor's buffer.
CXXFLAGS = "-O3 -fopenmp -DBYTEPS_BUILDING_SERVER -march=native -mno-avx512f -std=c++14 -w"
ROW = re.compile(r"^(\d+)\s+(.+?)\s{2,}([\d.]+)\s+([\d.]+|-)\s+([\d.]+)\s+([\d.]+)\s+(.*)$")


class Unavailable(Exception):
    """The reference was not measured. ``status``: "unavailable" (no compiler, no network, no
    sdist) or "failed" (it built or ran and went wrong: a bug here)."""

    def __init__(self, status, reason):
        super().__init__(reason)
        self.status = status


def cache_dir():
    return os.environ.get("BPS_GC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "bps_gc")


def _one_line(text):
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _download(cache):
    """The sdist's path in the cache, fetched with pip when it is not there yet."""
    path = os.path.join(cache, SDIST)
    if os.path.exists(path):
        return path
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
               ":all:", f"byteps=={VERSION}", "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable("unavailable", f"pip download byteps=={VERSION}: {e}") from None
        got = os.path.join(tmp, SDIST)
        if r.returncode != 0 or not os.path.exists(got):
            raise Unavailable("unavailable", f"pip download byteps=={VERSION} failed: "
                                             f"{_one_line(r.stderr or r.stdout)} (offline, set "
                                             f"BPS_GC_BYTEPS_SDIST to a copy of {SDIST})")
        os.replace(got, path)
    return path


def _read_sources(sdist):
    """{path under byteps/common/: bytes} from a .tar.gz (checked against SDIST_SHA256) or an
    unpacked sdist directory."""
    wanted = {f"byteps/common/{f}" for f in UPSTREAM}
    files = {}
    if os.path.isdir(sdist):
        for rel in wanted:
            try:
                with open(os.path.join(sdist, rel), "rb") as f:
                    files[rel] = f.read()
            except OSError as e:
                raise Unavailable("unavailable", f"{sdist} is not BytePS's sdist: {e}") from None
        return files
    try:
        with open(sdist, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise Unavailable("unavailable", f"cannot read the BytePS sdist: {e}") from None
    digest = hashlib.sha256(blob).hexdigest()
    if digest != SDIST_SHA256:
        raise Unavailable("failed", f"{sdist} has sha256 {digest}, not {SDIST} ({SDIST_SHA256})")
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for member in tar.getmembers():  # read by name into memory: nothing is extracted
            rel = member.name.split("/", 1)[-1]
            if rel in wanted and member.isfile():
                files[rel] = tar.extractfile(member).read()
    missing = wanted - set(files)
    if missing:
        raise Unavailable("failed", f"{sdist} lacks {sorted(missing)[0]}")
    return files


def _compiler():
    cxx = os.environ.get("CXX", "g++")
    try:
        r = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable("unavailable", f"no C++ compiler ({cxx}): {e}") from None
    if r.returncode != 0:
        raise Unavailable("unavailable", f"no C++ compiler ({cxx}): {_one_line(r.stderr)}")
    return cxx, r.stdout.splitlines()[0] if r.stdout else cxx


def _cpu_identity():
    """-march=native binaries belong to one kind of CPU: its model and flags join the key."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return ""
    pick = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(pick[:2])


def build(harness="bench.cc", cxxflags=CXXFLAGS):
    """Path of the reference binary, built (and cached) on first use; raises Unavailable.
    ``harness``: the file beside this one holding main() (bench.cc: timings; multistep.cc:
    multi-step vectors)."""
    try:
        return _build(harness, cxxflags)
    except OSError as e:  # e.g. a read-only cache or a full disk
        raise Unavailable("unavailable", f"building BytePS's codecs in {cache_dir()}: {e}") from None


def _build(harness, cxxflags):
    cache = cache_dir()
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as e:
        raise Unavailable("unavailable", f"cannot create the cache {cache}: {e}") from None
    cxx, cxx_version = _compiler()
    files = _read_sources(os.environ.get("BPS_GC_BYTEPS_SDIST") or _download(cache))
    for rel in [harness, *STUBS]:
        with open(os.path.join(HERE, rel), "rb") as f:
            files[rel] = f.read()
    h = hashlib.sha256("\n".join([cxxflags, cxx, cxx_version, _cpu_identity()]).encode())
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + files[rel])
    stem = os.path.splitext(harness)[0]
    name = "byteps_ref" if harness == "bench.cc" else f"byteps_ref-{stem}"
    binary = os.path.join(cache, f"{name}-{h.hexdigest()[:16]}")
    if os.path.exists(binary):
        return binary
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = os.path.join(tmp, "src")
        for rel, blob in files.items():
            # our stub stands in for byteps/common/common.h; bench.cc and the other stub beside it
            dest = os.path.join(src, "byteps/common/common.h" if rel == "stubs/common.h" else rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as f:
                f.write(blob)
        common = os.path.join(src, "byteps", "common")
        sources = [os.path.join(src, rel) for rel in files if rel.endswith(".cc")]
        out = os.path.join(tmp, stem)
        cmd = [*shlex.split(cxx), *cxxflags.split(), "-I", common, "-o", out, *sorted(sources)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable("failed", f"compiling BytePS's codecs: {e}") from None
        if r.returncode != 0:
            first_error = next((line for line in r.stderr.splitlines() if "error" in line),
                               r.stderr)
            raise Unavailable("failed", f"compiling BytePS's codecs failed: {_one_line(first_error)}")
        os.replace(out, binary)  # atomic: a concurrent run never starts a half-written file
    return binary


def parse(text):
    """{(n, BytePS's config label): row} from bench.cc's output."""
    rows = {}
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if m:
            n, label, comp, decomp, ratio, _, check = m.groups()
            rows[(int(n), label.strip())] = {
                "compress_gbps": float(comp),
                "decompress_gbps": None if decomp == "-" else float(decomp),
                "compression_ratio": float(ratio), "check": check.strip()}
    return rows


def run(binary, sizes, runs, threads=1, only=()):
    """(parse()'s rows, the raw output) of one run of the binary: ``sizes`` element counts,
    the median of ``runs`` timed calls after one warm-up, OpenMP and BytePS's reducer on
    ``threads`` threads; ``only``: just these configuration labels (default: all)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), BYTEPS_OMP_THREAD_PER_GPU=str(threads))
    with tempfile.TemporaryDirectory() as cwd:  # its error-feedback case writes lr.s here
        cmd = [binary, "--runs", str(runs), "--sizes", ",".join(str(n) for n in sizes)]
        if only:
            cmd += ["--only", ",".join(only)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd,
                               timeout=3600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable("failed", f"running {binary}: {e}") from None
    if r.returncode != 0:
        raise Unavailable("failed", f"{binary} exited {r.returncode}: "
                                    f"{_one_line(r.stderr or r.stdout)}")
    rows = parse(r.stdout)
    if not rows:
        raise Unavailable("failed", f"{binary} printed no result rows")
    return rows, r.stdout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000000,4000000,25000000", help="float32 element counts")
    ap.add_argument("--runs", type=int, default=7, help="timed calls per case (median taken)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for BytePS's loops")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes takes comma-separated element counts, not {args.sizes!r}")
    try:
        _, text = run(build(), sizes, args.runs, args.threads)
    except Unavailable as e:
        sys.exit(f"BytePS reference not measured: {e}")
    print(text, end="")


if __name__ == "__main__":
    main()
