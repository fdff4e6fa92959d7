#!/usr/bin/env python3
"""scripts/gpu_checks.sh --cpu-dry-run's steps, run in this one Python process: each step's
command line is the one the GPU run starts as a process (``PYTHON -m pytest ...``, ``PYTHON
script.py ...``), run here as Python would run it (runpy: ``-m`` a module, else a script with its
folder first on sys.path), its output (file descriptors 1 and 2, so its children's too) in
OUT/NAME.txt after the same "== NAME: command" line, then shown, and "== NAME: exit N" added
where it failed (124: past its time limit), as the shell's step() does. What a step leaves
behind is undone before the next (as tests/help_runner.py does): sys.argv, sys.path and the
modules it imported from this repository's example/, scripts/ and tests/ folders. Why: on the CPU, every
step's own interpreter imports torch again (~1.2 s of CPU each, 6 of them); the launchers and
ranks the steps start stay processes of their own.

    python scripts/gpu_checks_one_process.py OUT QUEUE

QUEUE holds the steps in order, NUL-separated: name, seconds allowed, the command's word count,
its words (the first, the interpreter, is this one). Exits 1 when a step failed.
"""
import os
import runpy
import signal
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN = tuple(os.path.join(ROOT, folder) + os.sep for folder in ("example", "scripts", "tests"))


class StepTimeout(BaseException):  # as KeyboardInterrupt: no step's own "except Exception" takes it
    pass


def past_the_limit(*_):
    raise StepTimeout


def read_queue(path):
    with open(path, "rb") as f:
        words = [w.decode() for w in f.read().split(b"\0")[:-1]]
    steps = []
    while words:
        name, limit, count = words[0], int(words[1]), int(words[2])
        steps.append((name, limit, words[3:3 + count]))
        words = words[3 + count:]
    return steps


def run_like_python(argv):
    """``python ARGV...`` in this process; its exit status."""
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]  # runpy puts the module's path first, as python -m does
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except StepTimeout:
        return 124
    except BaseException:  # noqa: B902 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        return 1
    return 0


def run_step(out, name, limit, command):
    log = os.path.join(out, f"{name}.txt")
    with open(log, "w") as f:
        f.write(f"== {name}: {' '.join(command)}\n")
    saved_argv, saved_path, loaded = sys.argv[:], sys.path[:], set(sys.modules)
    screen = [os.dup(fd) for fd in (1, 2)]
    sys.stdout.flush(), sys.stderr.flush()
    with open(log, "a") as f:
        for fd in (1, 2):
            os.dup2(f.fileno(), fd)
    signal.alarm(limit)
    try:
        status = run_like_python(command[1:])
    finally:
        signal.alarm(0)
        sys.stdout.flush(), sys.stderr.flush()
        for fd, kept in zip((1, 2), screen):
            os.dup2(kept, fd)
            os.close(kept)
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        for module_name, module in list(sys.modules.items()):
            if module_name not in loaded and (getattr(module, "__file__", None) or "").startswith(OWN):
                del sys.modules[module_name]
    if status:
        with open(log, "a") as f:
            f.write(f"== {name}: exit {status}\n")
    with open(log) as f:
        sys.stdout.write(f.read())
    sys.stdout.flush()
    return status


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.exit(f"usage: gpu_checks_one_process.py OUT QUEUE (got {len(argv)} argument(s))")
    out, queue = argv
    signal.signal(signal.SIGALRM, past_the_limit)
    failed = 0
    for name, limit, command in read_queue(queue):
        failed |= run_step(out, name, limit, command) != 0
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
