"""A job started as users start one across machines: one ``bpslaunch`` per role, each its own
process with DMLC_ROLE set, so failures are found by the job's own protocol (heartbeats,
goodbyes, registration checks) and not by a shared launcher tearing everything down."""
import os
import subprocess
import sys
import threading
import time

from bps_gc.launcher.local import free_port
from conftest import LAUNCH_PYTHONPATH, ROOT, alive

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from procs import child_of, stat_fields  # noqa: E402
from leftovers import PF_EXITING  # noqa: E402

INTERVAL, TIMEOUT = 0.2, 2.0
LAUNCH = [sys.executable, "-m", "bps_gc.launcher.cli"]


class Job:
    """``workers``: one script per worker (a string for all); ``env``: for every role;
    ``role_env``: per launcher name (scheduler, server0.., worker0..) overrides; ``command``: the
    workers' command (argv) instead of ``python -c script``."""

    def __init__(self, workers, script, servers=1, env=None, role_env=None, command=None):
        port = self.port = free_port()
        scripts = script if isinstance(script, list) else [script] * workers
        base = dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH,
                    DMLC_NUM_WORKER=str(workers), DMLC_NUM_SERVER=str(servers),
                    DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port), PYTHONUNBUFFERED="1",
                    BPS_GC_HEARTBEAT_INTERVAL=str(INTERVAL), BPS_GC_HEARTBEAT_TIMEOUT=str(TIMEOUT),
                    BPS_GC_KILL_GRACE="2")
        base.update(env or {})  # may set the heartbeat's too
        role_env = role_env or {}
        plan = {"scheduler": ([], dict(base, DMLC_ROLE="scheduler"))}
        for s in range(servers):
            plan[f"server{s}"] = ([], dict(base, DMLC_ROLE="server"))
        for w in range(workers):
            plan[f"worker{w}"] = (command or [sys.executable, "-c", scripts[w]],
                                  dict(base, DMLC_ROLE="worker", DMLC_WORKER_ID=str(w)))
        self.started = time.monotonic()
        self.base = base
        self.launchers, self.output = {}, {}
        for name, (command, env_) in plan.items():
            env_.update(role_env.get(name, {}))
            self.launch(name, command, env_)

    def launch(self, name, command, env):
        """Start one more bpslaunch (e.g. a worker host joining the running job)."""
        self.launchers[name] = subprocess.Popen([*LAUNCH, *command], env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True)
        self.output[name] = []
        threading.Thread(target=self.collect, args=(name,), daemon=True).start()

    def collect(self, name):
        for line in self.launchers[name].stdout:
            self.output[name].append(line)

    def text(self, name):
        return "".join(self.output[name])

    def report(self, statuses=None):
        return "\n".join(f"--- {n} ({(statuses or {}).get(n)})\n{self.text(n)[-2000:]}" for n in self.launchers)

    def child_of(self, name):
        """PID of the role process the launcher started."""
        pid = child_of(self.launchers[name].pid)
        if pid is None:
            raise AssertionError(f"no child of {name}'s launcher")
        return pid

    def local_rank_of(self, name, local_rank):
        """PID of local rank ``local_rank`` of a worker host's launcher (NVIDIA_VISIBLE_DEVICES)."""
        mark = f"BYTEPS_LOCAL_RANK={local_rank}".encode()
        for pid in processes_with(f"DMLC_PS_ROOT_PORT={self.port}"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if parent == self.launchers[name].pid and mark in f.read().split(b"\0"):
                        return pid
            except (OSError, IndexError, ValueError):
                continue
        raise AssertionError(f"no local rank {local_rank} of {name}'s launcher")

    def wait_output(self, names, marker, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if all(marker in self.text(n) for n in names):
                return
            time.sleep(0.05)
        self.kill_all()
        raise AssertionError(f"no {marker!r} from {names}:\n{self.report()}")

    def wait_all(self, bound, since=None):
        """Every launcher's exit status, and the seconds since ``since`` when the last exited;
        asserts they all exit within ``bound`` seconds."""
        since = self.started if since is None else since
        statuses = {}
        try:
            for name, proc in self.launchers.items():
                try:
                    statuses[name] = proc.wait(timeout=max(bound - (time.monotonic() - since), 0.1))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{name} still runs after {bound} s:\n{self.report(statuses)}") from None
        finally:
            self.kill_all()
        elapsed = time.monotonic() - since
        deadline = time.monotonic() + 3  # exited launchers' children are being reaped
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.leftovers()
        assert not left, f"processes left behind: {described(left)}"
        return statuses, elapsed

    def leftovers(self):
        """PIDs of live processes of this job (found by its scheduler port in their environment)."""
        return processes_with(f"DMLC_PS_ROOT_PORT={self.port}")

    def kill_all(self):
        for proc in self.launchers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def described(pids):
    """Each of ``pids`` as "pid (state S, parent P, exiting or not): command line", or "pid (gone)":
    what a leftover was, for a failure seen once under load."""
    lines = []
    for pid in pids:
        try:
            fields = stat_fields(pid)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
            exiting = ", exiting" if int(fields[6]) & PF_EXITING else ""
            lines.append(f"{pid} (state {fields[0]}, parent {fields[1]}{exiting}): {command}")
        except (OSError, IndexError, ValueError):
            lines.append(f"{pid} (gone)")
    return "; ".join(lines)


def processes_with(variable):
    """PIDs of live processes (not this one) whose environment holds ``variable`` ("NAME=value")."""
    mark = variable.encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0") and alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                continue
    return found
