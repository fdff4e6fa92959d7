"""A group of child processes that live and die together.

SIGINT/SIGTERM to the launcher go to every child (their whole process groups). When a child
fails, the others are stopped: SIGTERM, then SIGKILL after the grace. Every child is reaped
before the launcher exits, and anything left in the children's process groups is killed.
"""
import os
import signal
import time

from .output import say
from .spawn import exit_status, spawn

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_SECONDS = 0.05  # how often children are checked; bounds the launcher's reaction time


class Child:
    def __init__(self, name, proc):
        self.name = name
        self.proc = proc
        self.status = None  # shell-style exit status once reaped

    @property
    def running(self):
        return self.status is None

    def reap(self):
        """True if it has exited (now or before)."""
        if self.status is None:
            returncode = self.proc.poll()
            if returncode is not None:
                self.status = exit_status(returncode)
        return self.status is not None

    def signal(self, signum):
        if self.running:
            _signal_group(self.proc.pid, signum)


class Supervisor:
    def __init__(self, kill_grace):
        self.kill_grace = kill_grace
        self.children = []
        self.received = None  # last signal forwarded, if any

    def forward_signals(self):
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, _frame):
        self.received = signum
        for child in self.children:
            child.signal(signum)

    def start(self, name, argv, env, cpus=None, **popen_kwargs):
        """Start a child (from the main thread: see spawn.py). Raises OSError if it cannot run."""
        child = Child(name, spawn(argv, env, cpus, **popen_kwargs))
        self.children.append(child)
        if self.received is not None:  # the signal came while it was being started
            child.signal(self.received)
        return child

    def start_all(self, plan, on_started=None, **popen_kwargs):
        """Start (name, argv, env, cpus) children in order, unless a signal asks us to stop.
        Returns None, or the exit status for a command that cannot run (127: not found)."""
        for name, argv, env, cpus in plan:
            if self.received is not None:
                return None
            try:
                child = self.start(name, argv, env, cpus, **popen_kwargs)
            except OSError as error:
                say(f"cannot run {argv[0]!r} for {name}: {error.strerror or error}")
                return 127 if isinstance(error, FileNotFoundError) else 126
            if on_started is not None:
                on_started(child)
        return None

    def wait(self, until, deadline=None):
        """Reap children until one fails (it is returned), until() holds, or the monotonic
        deadline passes (None is returned in both cases)."""
        while True:
            for child in self.children:
                if child.running and child.reap() and child.status != 0:
                    return child
            if until() or (deadline is not None and time.monotonic() >= deadline):
                return None
            time.sleep(POLL_SECONDS)

    def all_exited(self):
        return not any(child.running for child in self.children)

    def still_running(self):
        return [child for child in self.children if child.running]

    def stop_all(self):
        """SIGTERM the running children, SIGKILL those left after the grace; reap them all."""
        for child in self.still_running():
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace
        while self.still_running() and time.monotonic() < deadline:
            for child in self.still_running():
                child.reap()
            time.sleep(POLL_SECONDS)
        for child in self.still_running():
            child.signal(signal.SIGKILL)
        for child in self.still_running():
            child.proc.wait()
            child.reap()

    def sweep(self):
        """Kill what the (reaped) children left behind in their process groups."""
        for child in self.children:
            _signal_group(child.proc.pid, signal.SIGKILL)

    def exit_status(self, failed):
        """The launcher's status: the failed child's, else 128+N after a forwarded signal N."""
        if failed is not None:
            return failed.status
        if self.received is not None:
            return 128 + int(self.received)
        return 0


def _signal_group(pgid, signum):
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):  # group already empty
        pass
