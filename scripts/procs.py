"""Processes seen through /proc, for the scripts and tests that start jobs and kill their parts."""
import os


def children(parent):
    """{pid: (state, command line)} of process ``parent``'s children, zombies included, in
    /proc's order."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the fields after the command name (which may hold spaces and ')'): state, ppid, ...
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        found[int(entry)] = (fields[0], command)
    return found


def child_of(parent):
    """PID of a child of process ``parent`` (a launcher's one role process), or None."""
    return next(iter(children(parent)), None)
