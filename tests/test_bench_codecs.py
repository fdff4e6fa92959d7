"""scripts/bench_codecs.py --quick end to end, with BytePS's reference built from its sdist
(cached under ~/.cache/bps_gc after the first run: about 10 s once, then a few seconds), and
without it. The numbers are never asserted as timings; what is checked is that every cell's
ratio is ours over what BytePS's binary printed in the same run."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import LAUNCH_PYTHONPATH, ROOT, load_script

SCRIPT = os.path.join(ROOT, "scripts", "bench_codecs.py")
BYTEPS_CODECS = ("onebit scaling", "topk 0.1%", "topk 1%", "randomk 0.1%", "randomk 1%",
                 "dithering k=2 linear", "dithering k=2 natural", "EF + onebit", "EF + topk 1%")
# bench.cc's row: N, label, comp_GB/s, decomp_GB/s, ratio, comp_ms, check
RAW_ROW = re.compile(r"^(\d+) +(\S.*?\S) {2,}([\d.]+) +([\d.]+|-) +([\d.]+) +[\d.]+ +(\S.*)$")


def run_bench(tmp_path, *args, env=None):
    out = tmp_path / "codecs.json"
    r = subprocess.run([sys.executable, SCRIPT, "--quick", "--json", str(out), *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH, **(env or {})))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    return r.stdout, json.loads(out.read_text())


def test_quick_against_byteps_measured_in_the_same_run(tmp_path):
    stdout, data = run_bench(tmp_path)
    assert re.search(r"^machine: .+, \d+ cores, (no )?AVX2, ", stdout, re.M)
    rows = {(r["codec"], r["size"]): r for r in data["rows"]}
    assert {codec for codec, _ in rows} >= {"memcpy", *BYTEPS_CODECS, "terngrad", "powersgd r=1"}
    ref = data["byteps"]
    if ref["status"] == "unavailable":  # no compiler or no network on this machine
        assert f"BytePS reference not measured: {ref['reason']}" in stdout
        pytest.skip(f"BytePS's reference cannot be built here: {ref['reason']}")
    assert ref["status"] == "measured", ref
    # re-read BytePS's raw output independently of the script's parser
    theirs = {}
    for text in ref["output"]:
        for line in text.splitlines():
            m = RAW_ROW.match(line)
            if m:
                theirs[(int(m[1]), m[2])] = (float(m[3]), None if m[4] == "-" else float(m[4]), m[6])
    labels = {"onebit scaling": "onebit(scaling)", "topk 0.1%": "topk k=0.1%",
              "topk 1%": "topk k=1%", "randomk 0.1%": "randomk k=0.1%",
              "randomk 1%": "randomk k=1%", "dithering k=2 linear": "dithering k=2 linear/max",
              "dithering k=2 natural": "dithering k=2 natural/max",
              "EF + onebit": "EF(vanilla)+onebit(scaling)", "EF + topk 1%": "EF(vanilla)+topk k=1%"}
    for codec in BYTEPS_CODECS:
        row = rows[(codec, "256K")]
        comp, decomp, check = theirs[(256_000, labels[codec])]
        assert check.startswith("ok"), (codec, check)  # BytePS's codec did its job
        assert row["ref"] == "BytePS"
        assert (row["ref_compress_gbps"], row["ref_decompress_gbps"]) == (comp, decomp)
        assert row["x_compress"] == pytest.approx(row["compress_gbps"] / comp)
        assert row["x_decompress"] == pytest.approx(row["decompress_gbps"] / decomp)
        # same configuration on both sides: the same bytes on the wire (within the header)
        assert row["compression_ratio"] == pytest.approx(row["ref_compression_ratio"], rel=0.02)
    memcpy = rows[("memcpy", "256K")]
    assert memcpy["ref_compress_gbps"] == theirs[(256_000, "memcpy (1 thread)")][0]
    for name in ("BytePS", "PyTorch"):
        assert f"below 1.0x against {name}: " in stdout


def test_quick_says_in_one_line_when_byteps_cannot_be_built(tmp_path):
    stdout, data = run_bench(tmp_path, "--only", "onebit,terngrad",
                             env={"CXX": str(tmp_path / "no-such-compiler")})
    lines = [line for line in stdout.splitlines() if line.startswith("BytePS reference not measured: ")]
    assert lines and "no-such-compiler" in lines[0]
    assert data["byteps"]["status"] == "unavailable"
    onebit = next(r for r in data["rows"] if r["codec"] == "onebit scaling")
    assert onebit["compress_gbps"] > 0 and onebit["ref_compress_gbps"] is None
    assert onebit["x_compress"] is None and "target" not in onebit
    assert re.search(r"^onebit scaling .* BytePS +not measured ", stdout, re.M)
    assert "below 1.0x against BytePS: not measured" in stdout
    # the torch side still measured
    terngrad = next(r for r in data["rows"] if r["codec"] == "terngrad")
    if terngrad.get("ref") == "torch":
        assert terngrad["x_compress"] == pytest.approx(terngrad["compress_gbps"] / terngrad["ref_compress_gbps"])


def test_quick_device_rows_beside_ours(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    stdout, data = run_bench(tmp_path, "--only", "onebit", "--no-reference", "--device", "cpu")
    assert data["byteps"]["status"] == "skipped"
    assert "device chains on cpu" in stdout
    rows = {r["codec"]: r for r in data["device_rows"]}
    assert {"onebit scaling", "EF + onebit"} <= set(rows)
    for row in rows.values():
        assert row["device"] == "cpu" and row["size"] == "256K" and row["compress_gbps"] > 0
        assert row["speedup"][0] == pytest.approx(row["compress_gbps"] / row["host_compress_gbps"])
    if not torch.cuda.is_available():  # a usage error naming the cause, no traceback
        # argparse's exit 2 from main(), in this process: the refusal comes before any work, and
        # a process of its own would import torch again (~1.2 s of CPU) to say it
        with pytest.raises(SystemExit) as refused:
            load_script(SCRIPT).main(["--quick", "--device", "cuda"])
        stderr = capsys.readouterr().err
        assert refused.value.code == 2 and "torch.cuda.is_available() is False" in stderr
        assert "Traceback" not in stderr
