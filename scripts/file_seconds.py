"""Writes tests/file_seconds.json from the seconds pytest's cache recorded for each test in the
last runs (tests/conftest.py): each test file's total, which a fresh clone (CI) orders the suite
by, heaviest file first.

    ./scripts/test.sh && .venv/bin/python scripts/file_seconds.py
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".pytest_cache", "v", "bps_gc", "test_seconds")


def main():
    if not os.path.exists(CACHE):
        sys.exit(f"file_seconds: no recorded seconds at {CACHE}; run ./scripts/test.sh first")
    totals = {}
    for nodeid, seconds in json.load(open(CACHE)).items():
        path = nodeid.split("::", 1)[0]
        totals[path] = round(totals.get(path, 0.0) + seconds, 1)
    out = os.path.join(ROOT, "tests", "file_seconds.json")
    with open(out, "w") as f:
        json.dump(dict(sorted(totals.items(), key=lambda kv: -kv[1])), f, indent=0)
        f.write("\n")
    print(f"{out}: {len(totals)} files, {sum(totals.values()):.0f} s in all")


if __name__ == "__main__":
    main()
