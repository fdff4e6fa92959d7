"""Processes seen through /proc, for the scripts and tests that start jobs and kill their parts."""
import os


def stat_fields(pid):
    """/proc/PID/stat's fields after the command name (which may hold spaces and ')'): state,
    ppid, pgrp, session, tty, tpgid, flags, ...; OSError once the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def children(parent):
    """{pid: (state, command line)} of process ``parent``'s children, zombies included, in
    /proc's order."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = stat_fields(entry)
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
