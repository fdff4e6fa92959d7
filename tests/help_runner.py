"""``python help_runner.py SCRIPT...``: runs each script as ``SCRIPT --help`` would (``__main__``,
its folder first on sys.path, argv), one after the other in this one process, and prints a JSON
object {script: {"returncode", "stdout", "stderr"}} (tests/test_example_help.py). What one script
leaves behind is undone before the next: sys.path, sys.argv, and every module imported from this
repository's example/, scripts/ and tests/ folders; the frameworks stay imported (most scripts
import torch: a second apiece)."""
import contextlib
import io
import json
import os
import runpy
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN = tuple(os.path.join(ROOT, folder) + os.sep for folder in ("example", "scripts", "tests"))


def run_help(script):
    out, err = io.StringIO(), io.StringIO()
    path, argv = list(sys.path), list(sys.argv)
    sys.argv = [script, "--help"]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if stop.code is not None and not isinstance(stop.code, int):
                    print(stop.code, file=sys.stderr)
            except BaseException:  # noqa: B902 - reported as the interpreter would
                traceback.print_exc()
                code = 1
    finally:
        sys.path[:], sys.argv = path, argv
        for name, module in list(sys.modules.items()):
            if (getattr(module, "__file__", None) or "").startswith(OWN):
                del sys.modules[name]
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    results = {script: run_help(script) for script in sys.argv[1:]}
    sys.stdout.write(json.dumps(results))
