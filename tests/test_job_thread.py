"""JobThread at the interpreter's exit: a job still inside torch's C++ (the GIL released) when
the script ends must not abort the process. A daemon thread that takes the GIL back while the
interpreter finalizes is stopped mid-unwind through C++ frames, and the process dies with
"terminate called without an active exception" (status 134) after a script that ended well:
seen once in the suite, a DDP hook job's rank settling its last future. The JobThreads are
stopped and joined (bounded) at exit."""
import subprocess
import sys
import textwrap

from conftest import ROOT

SCRIPT = textwrap.dedent(f"""
    import sys, threading
    sys.path.insert(0, {ROOT!r})
    import torch
    from bps_gc.collective.job_thread import JobThread
    torch.set_num_threads(1)
    a = torch.randn(2000, 2000)
    started = threading.Event()
    runner = JobThread("job")
    runner.submit(started.set)
    runner.submit(torch.mm, a, a)  # ~0.2 s inside torch's C++ with the GIL released
    started.wait()  # the script ends while the product runs
""")


def test_a_job_inside_torch_at_exit_does_not_abort_the_process():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "terminate called" not in result.stderr
