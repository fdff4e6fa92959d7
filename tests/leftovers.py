"""Processes a test file leaves running. ``subprocess.run(timeout=)`` kills the launcher it started
and nothing under it: a torchrun killed so left its ranks running for minutes, on the cores the
next tests needed (a bpslaunch's die with it: PR_SET_PDEATHSIG). The pytest process makes itself
their subreaper (Linux): a descendant whose parent dies becomes its child rather than init's,
so once a file's tests are done (tests/conftest.py) whatever is still its child is a leftover,
killed and named."""
import ctypes
import os
import signal
import sys
import time

# scripts/procs.py reads /proc for the tests already; appended, not first: tests/fsdp_bytes.py has a
# namesake in scripts/
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from procs import children, stat_fields  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36


class LeftoverProcesses(UserWarning):
    """A test file left processes running (tests/conftest.py warns with their command lines)."""


def become_subreaper():
    """True where the kernel took it (Linux 3.4+)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


PF_EXITING = 0x4  # the kernel's flag on a task in its exit


def dying(pid):
    """True if ``pid`` has a SIGKILL pending or is exiting: a launcher's child whose parent death
    signal (bps_gc/launcher/spawn.py) fired as the launcher was killed, not yet scheduled to die.
    A file's last test killing its launchers hands such children to the guard still running (9
    of 20 right after the launcher's wait(), on this box), and they are not left behind."""
    try:
        if int(stat_fields(pid)[6]) & PF_EXITING:
            return True
        with open(f"/proc/{pid}/status") as f:
            return any(int(line.split()[1], 16) & (1 << (signal.SIGKILL - 1))
                       for line in f if line.startswith(("SigPnd:", "ShdPnd:")))
    except (OSError, ValueError, IndexError):  # gone meanwhile
        return True


def reap_leftovers(where, rounds=20):
    """Kill this process's children still running and reap them (a killed one's own children
    come to this process next: up to ``rounds`` rounds). Returns the command lines killed, each
    also named on stderr with ``where``. Zombies (adopted processes that ended) are reaped
    silently: every test's own launches were waited for before its file ended; so are processes
    already dying (``dying``), waited for until they are zombies."""
    me, killed = os.getpid(), []
    for _ in range(rounds):
        found = children(me)
        if not found:
            break
        for pid, (state, command) in found.items():
            if state != "Z" and not dying(pid):
                killed.append(command)
                print(f"tests: {where} left pid {pid} running, killed: {command[:200]}", file=sys.stderr)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.05)
        for pid in found:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return killed
