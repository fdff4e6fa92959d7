"""Writes tests/file_seconds.json: each test file's seconds (its tests' setup + call + teardown,
summed) from this checkout's pytest cache, which tests/conftest.py records at every run. A
checkout without a cache (a fresh clone, CI) orders the suite's files by it, heaviest first, so
that neither pytest process is left with a long file at the end while the other idles.

    .venv/bin/python scripts/record_test_order.py      # after a full ./scripts/test.sh
"""
import collections
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".pytest_cache", "v", "bps_gc", "test_seconds")
OUT = os.path.join(ROOT, "tests", "file_seconds.json")


def main():
    with open(CACHE) as f:
        seconds = json.load(f)
    by_file = collections.Counter()
    for nodeid, spent in seconds.items():
        path = nodeid.split("::", 1)[0]
        if os.path.exists(os.path.join(ROOT, path)):  # files since removed are dropped
            by_file[path] += spent
    with open(OUT, "w") as f:
        json.dump({path: round(spent, 1) for path, spent in sorted(by_file.items())}, f, indent=0, sort_keys=True)
        f.write("\n")
    print(f"{OUT}: {len(by_file)} files, {sum(by_file.values()):.0f} s in all")


if __name__ == "__main__":
    main()
