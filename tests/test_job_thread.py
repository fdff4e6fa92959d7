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


def test_a_job_whose_call_fails_ends_with_its_error_and_is_raised_at_the_next_wait():
    """A function that raises before its own error handling (a programming error: last stop's
    ``Driver.compress`` called with the wrong arguments) used to be printed by the thread alone:
    the bucket, segment or pipeline job it carried never ended, and its rank waited until the
    tests' timeouts. Each now ends with the error (JobFailed naming the function and the cause),
    every later ``wait_idle`` raises it, and the thread still runs later jobs."""
    import threading

    import pytest
    import torch

    from bps_gc.collective.buckets import Bucket
    from bps_gc.collective.exchange.driver import Driver
    from bps_gc.collective.exchange.jobs import ArraySegment, TensorJob
    from bps_gc.collective.job_thread import JobFailed, JobThread

    runner = JobThread("test-exchange")
    driver = Driver(lambda **amounts: None, runner, runner, runner)
    bucket, segment = Bucket(), ArraySegment([], {})
    runner.submit(driver.compress, segment, None, "one argument too many")
    runner.submit(lambda bucket, wanted: None, bucket)  # one too few

    # a stage that fails outside its own try: segments without the Segment interface
    job = TensorJob([object()], wait=None, future=torch.futures.Future())
    driver.run(job)
    ran = threading.Event()
    runner.submit(ran.set)  # the thread still runs later jobs; once it has, every job above has ended
    assert ran.wait(10)
    assert job.future.done(), "the pipeline job never ended"
    with pytest.raises(JobFailed, match=r"test-exchange: Driver\.compress_stage failed: AttributeError"):
        job.future.wait()
    assert bucket.sent.is_set(), "the bucket was never sent nor failed"
    assert isinstance(bucket.error, JobFailed) and "TypeError" in str(bucket.error), bucket.error
    assert isinstance(segment.failure, JobFailed) and "Driver.compress failed: TypeError" in str(segment.failure)
    assert segment.compressed and isinstance(segment.failure.__cause__, TypeError)
    with pytest.raises(JobFailed, match="Driver.compress failed"):  # the first failure, raised at every wait
        runner.wait_idle(10)
    runner.stop()


def test_a_ctrl_c_as_submit_releases_its_lock_leaves_no_job_counted_and_not_queued():
    """Ctrl-C reaches the caller's thread as submit() leaves its lock (the lock's __exit__, where
    Python runs signal handlers): the job it counted must be queued too, or every later wait
    for the thread to be idle (the rank's drain at exit) waits for ever."""
    import threading

    from bps_gc.collective.job_thread import JobThread
    runner, ran = JobThread("job"), []
    runner.submit(ran.append, "first")  # the thread is started
    assert runner.wait_idle(10)
    release = threading.Condition.__exit__.__code__

    def ctrl_c_at_the_release(frame, event, arg):
        if event == "call" and frame.f_code is release:
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(ctrl_c_at_the_release)
    try:
        runner.submit(ran.append, "second")
        raise AssertionError("the interrupt did not reach submit()")
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    assert runner.wait_idle(5), (runner.submitted, runner.completed, ran)
    assert ran == ["first", "second"]
    runner.stop()
