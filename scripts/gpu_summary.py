#!/usr/bin/env python3
"""The one table scripts/gpu_checks.sh ends with: every check of its run folder against issue
32's targets, read from the files the checks wrote (pytest logs, bench_device_codecs JSON, the
synthetic benchmark's JSON for 1 rank and 2 ranks sharing the GPU, dgc_shared_gpu.json).
A check whose file is missing is "not run". Writes OUT/summary.md; exits 1 when a check failed.

    python scripts/gpu_summary.py out/gpu
"""
import json
import os
import re
import sys

CODEC_TARGETS = [  # (bench_device_codecs codec, column, GB/s at least), at 25M elements
    ("onebit scaling", "compress_gbps", 500), ("onebit scaling", "decompress_gbps", 500),
    ("EF + onebit", "compress_gbps", 300), ("topk 1%", "compress_gbps", 200)]
CODEC_SHARE = 0.05  # each bps_gc codec's time per step over the step without communication


def load(path):
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def pytest_rows(out):
    rows = []
    for name in ("tests_chains", "tests_cuda"):
        path = os.path.join(out, f"{name}.txt")
        if not os.path.isfile(path):
            rows.append((f"pytest {name}", "not run", ""))
            continue
        text = open(path).read()
        last = [line for line in text.splitlines() if re.search(r"\b(passed|failed|error|no tests ran|collected)\b", line)]
        result = last[-1].strip("= ") if last else "no summary line"
        ok = "failed" not in result and "error" not in result and "no tests ran" not in result
        rows.append((f"pytest {name}", "ok" if ok else "FAILED", result))
    return rows


def codec_rows(out):
    rows = load(os.path.join(out, "bench_device_codecs_cuda.json"))
    if rows is None:
        return [(f"{codec} {column} >= {target} GB/s (25M)", "not run", "") for codec, column, target in CODEC_TARGETS]
    rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
    out_rows = []
    for codec, column, target in CODEC_TARGETS:
        match = [r for r in rows if r["codec"] == codec and r["size"] == "25M"]
        if not match:
            out_rows.append((f"{codec} {column} >= {target} GB/s (25M)", "not run", ""))
            continue
        value = match[0][column]
        out_rows.append((f"{codec} {column} >= {target} GB/s (25M)", "ok" if value >= target else "below target",
                         f"{value:.1f} GB/s"))
    return out_rows


def synthetic_rows(out):
    rows = []
    for ranks in (1, 2):
        report = load(os.path.join(out, f"synthetic_{ranks}rank.json"))
        if report is None:
            rows.append((f"synthetic benchmark, {ranks} rank(s)", "not run", ""))
            continue
        rows.append((f"synthetic benchmark, {ranks} rank(s)", "ok",
                     f"{report['model']} batch {report['batch_size']}, {report['device']}"))
        for r in report["results"]:
            speed = f"{r['images_per_sec_per_gpu']:.0f} img/s/GPU, {r['ms_per_step']:.1f} ms/step"
            codec = r["codec_ms_per_step"]
            if codec is None:
                rows.append((f"  {ranks}r {r['row']}", "ok", speed))
                continue
            share = r["codec_fraction_of_step"]
            detail = f"{speed}; codec {codec:.2f} ms" + (f" = {100 * share:.1f}% of step" if share is not None else "")
            verdict = "ok"
            if ranks == 1 and (r["row"].startswith("bps_gc hook") or "DistributedOptimizer" in r["row"]):
                verdict = "ok" if share is not None and share <= CODEC_SHARE else "above 5%"
            rows.append((f"  {ranks}r {r['row']}", verdict, detail))
    return rows


def dgc_rows(out):
    rows = load(os.path.join(out, "dgc", "dgc_shared_gpu.json"))
    if rows is None:
        return [("DGC ResNet-20, 2 ranks sharing the GPU", "not run", "")]
    result = []
    for r in rows:
        if "error" in r:
            result.append((f"DGC ResNet-20 2 ranks, {r['transport']}", "FAILED", f"exit {r['exit']}"))
            continue
        verdict = "ok" if r["identical"] and r["loss_fell"] else "FAILED"
        result.append((f"DGC ResNet-20 2 ranks, {r['transport']}", verdict,
                       f"{r['steps']} steps, loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, ranks identical "
                       f"{r['identical']}; {r['device']}" + (f"; {r['backend_note']}" if r["backend_note"] else "")))
    return result


def main(argv=None):
    out = (argv or sys.argv[1:] or ["out/gpu"])[0]
    machine = open(os.path.join(out, "machine.txt")).read().strip() if os.path.isfile(
        os.path.join(out, "machine.txt")) else "(no machine.txt)"
    rows = pytest_rows(out) + codec_rows(out) + synthetic_rows(out) + dgc_rows(out)
    width = max(len(r[0]) for r in rows)
    lines = ["# scripts/gpu_checks.sh summary", "", "```", machine, "```", "",
             f"| {'check':<{width}} | verdict | detail |", f"|{'-' * (width + 2)}|---------|--------|"]
    lines += [f"| {name:<{width}} | {verdict} | {detail} |" for name, verdict, detail in rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 1 if any(v in ("FAILED",) for _, v, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
