"""Where the test suite's CPU goes: runs pytest (one process, so every launched process is
counted once) with BPS_GC_CENSUS set, so that each process the tests start records its CPU
seconds at exit (tests/sitecustomize.py), then prints the sums by kind of process and the tests
that cost the most, and writes them as JSON. Processes killed by a signal record nothing.

    python scripts/suite_census.py tests/test_restart_state.py tests/test_lm.py
    python scripts/suite_census.py --json out/census.json -k resume tests/
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_common import machine_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kind(line):
    if line["dynamo"]:
        return "torch + torch._dynamo (a torch optimizer or DDP built)"
    return "torch, no torch._dynamo" if line["torch"] else "no torch (bpslaunch, scheduler, servers, ...)"


def summarise(lines, per_test=()):
    kinds = collections.defaultdict(list)
    tests = collections.defaultdict(list)
    scripts = collections.defaultdict(list)
    for line in lines:
        kinds[kind(line)].append(line["cpu"])
        scripts[(kind(line), line.get("script", "-"))].append(line["cpu"])
        tests[line["test"] or "(no test)"].append(line["cpu"])
    total = sum(line["cpu"] for line in lines)
    by_kind = [{"kind": k, "processes": len(v), "cpu_s": round(sum(v), 1), "median_cpu_s": round(statistics.median(v), 2)}
               for k, v in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))]
    # which programs are behind each kind: a launcher or server that imports torch shows here
    by_script = [{"kind": k, "script": name, "processes": len(v), "cpu_s": round(sum(v), 1),
                  "median_cpu_s": round(statistics.median(v), 2)}
                 for (k, name), v in sorted(scripts.items(), key=lambda kv: -sum(kv[1]))]
    by_test = [{"test": t, "processes": len(v), "cpu_s": round(sum(v), 1)}
               for t, v in sorted(tests.items(), key=lambda kv: -sum(kv[1]))]  # all: the JSON's
    # per test, from the pytest process (tests/conftest.py): its own CPU and that of the processes it
    # waited for, killed ones included: what the test costs in all
    whole = [{"test": t["pytest_test"], "own_cpu_s": round(t["own_cpu"], 1), "launched_cpu_s": round(t["waited_cpu"], 1),
              "cpu_s": round(t["own_cpu"] + t["waited_cpu"], 1)} for t in per_test]
    return {"box": machine_info(), "processes": len(lines), "cpu_s": round(total, 1),
            "pytest_own_cpu_s": round(sum(t["own_cpu_s"] for t in whole), 1),
            "tests_cpu_s": round(sum(t["cpu_s"] for t in whole), 1), "by_kind": by_kind, "by_script": by_script, "by_test": by_test,
            "tests": sorted(whole, key=lambda t: -t["cpu_s"])}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the sums here too")
    p.add_argument("--top", type=int, default=25, help="how many of the costliest tests to list")
    args, pytest_args = p.parse_known_args()  # the rest is pytest's (test files, -k ...)
    if not pytest_args:
        p.error("name what pytest runs: test files, -k ...")
    # a process still ending after pytest (one a test left) may write its line as the folder goes
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        path = os.path.join(tmp, "census.jsonl")
        env = dict(os.environ, BPS_GC_CENSUS=path)
        # as scripts/test.sh: with PYTHONDONTWRITEBYTECODE set (this box's shells set it) and a checkout
        # without bytecode yet (a fresh worktree), every process compiled this repository's modules again
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        status = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                                 env=env, cwd=ROOT)
        with open(path) if os.path.exists(path) else open(os.devnull) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    per_test = [line for line in lines if "pytest_test" in line]
    report = summarise([line for line in lines if "pytest_test" not in line], per_test)
    print(f"\n{report['processes']} processes launched by the tests, {report['cpu_s']} s of CPU; box: {report['box']}")
    print(f"{'processes':>9} {'CPU s':>8} {'median':>7}  kind")
    for row in report["by_kind"]:
        print(f"{row['processes']:>9} {row['cpu_s']:>8} {row['median_cpu_s']:>7}  {row['kind']}")
    print(f"\n{'processes':>9} {'CPU s':>8} {'median':>7}  program (argv[0]) and its kind")
    for row in report["by_script"][:args.top]:
        print(f"{row['processes']:>9} {row['cpu_s']:>8} {row['median_cpu_s']:>7}  {row['script']}: {row['kind']}")
    print(f"\n{'processes':>9} {'CPU s':>8}  test")
    for row in report["by_test"][:args.top]:
        print(f"{row['processes']:>9} {row['cpu_s']:>8}  {row['test']}")
    print(f"\nin all (the pytest process's own CPU + the processes it waited for): {report['tests_cpu_s']} s, "
          f"of which pytest's own {report['pytest_own_cpu_s']} s")
    print(f"{'CPU s':>8} {'own':>6}  test")
    for row in report["tests"][:args.top]:
        print(f"{row['cpu_s']:>8} {row['own_cpu_s']:>6}  {row['test']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
