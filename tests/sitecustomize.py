"""Every process the tests launch has tests/ on its PYTHONPATH, so Python imports this at its start.
It does nothing unless BPS_GC_CENSUS names a file: then, at exit, the process appends one JSON line
there (its script, the test that launched it, its CPU seconds, whether it imported torch and
torch._dynamo). scripts/suite_census.py sets it and sums the lines: where the suite's CPU goes.
First, in every such process, torch and the other big packages import with the garbage collector
paused (tests/gc_paused_imports.py says why)."""
import os

import gc_paused_imports

gc_paused_imports.install()

if os.environ.get("BPS_GC_CENSUS"):
    import atexit
    import json
    import resource
    import sys

    def _record(path=os.environ["BPS_GC_CENSUS"]):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        line = {"script": os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "-",
                "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                "cpu": usage.ru_utime + usage.ru_stime, "torch": "torch" in sys.modules,
                "dynamo": "torch._dynamo" in sys.modules}
        try:
            with open(path, "a") as f:  # one short write per process: lines do not interleave
                f.write(json.dumps(line) + "\n")
        except OSError:
            pass

    atexit.register(_record)
