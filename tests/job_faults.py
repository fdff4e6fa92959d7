"""The fault a rank of a sharded job injects in itself (tests/test_sharded_faults.py runs
tests/fsdp_job.py and tests/diloco_resume_job.py so)."""
import os
import signal
import sys
import time


def fault_at(step, at, rank, spec, out):
    """At step 2 every rank writes OUT/pid<rank> (it runs); at step ``at`` rank spec "victim"
    writes OUT/fault_time, then does spec "fault": "kill" (SIGKILL itself), "exit"
    (sys.exit(0)) or anything else: raise."""
    if step == 2:
        open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
    if step == at and rank == spec.get("victim"):
        open(os.path.join(out, "fault_time"), "w").write(repr(time.time()))
        if spec["fault"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec["fault"] == "exit":
            sys.exit(0)
        raise RuntimeError(f"the training script failed on rank {rank}")
