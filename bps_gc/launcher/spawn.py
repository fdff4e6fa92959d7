"""Starting one child process so that it can never outlive the launcher.

Each child gets:
  * its own process group, so stopping it also stops what it started (killpg), and a
    terminal's Ctrl-C reaches it once, through the launcher, not twice;
  * PR_SET_PDEATHSIG=SIGKILL (Linux), so a SIGKILLed launcher takes it down. The kernel sends it
    when the *thread* that forked dies: start children from the main thread only;
  * optionally a CPU set, applied before exec because affinity set later from outside would
    not reach threads the program has already started.
"""
import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
_SIGKILL = int(signal.SIGKILL)


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved here, in the parent: the forked child must not load libraries (locks held by other
# threads at fork time would deadlock it).
_prctl = _load_prctl()


def spawn(argv, env, cpus=None, **popen_kwargs):
    """subprocess.Popen(argv) set up as described above; stdin is /dev/null."""
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, close_fds=True,
                            preexec_fn=_child_setup(os.getpid(), cpus), **popen_kwargs)


def _child_setup(launcher_pid, cpus):
    def setup():  # runs in the child between fork and exec: a few system calls, nothing more
        os.setpgid(0, 0)
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
            if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
                os.kill(os.getpid(), _SIGKILL)
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:  # e.g. CPUs taken away meanwhile: run unbound rather than not at all
                pass
    return setup


def exit_status(returncode):
    """Popen.returncode as a shell exit status: killed by signal N => 128 + N."""
    return 128 - returncode if returncode < 0 else returncode
