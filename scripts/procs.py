"""Processes seen through /proc, for the scripts and tests that start jobs and kill their parts."""
import os


def child_of(parent):
    """PID of a child of process ``parent`` (a launcher's one role process), or None."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # the field after the command name (which may hold spaces and ')'): state, then ppid
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        return int(entry)
            except (OSError, IndexError, ValueError):
                continue
    return None
