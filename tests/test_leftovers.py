"""The suite's own guard against orphans (tests/leftovers.py): a launcher killed under its
children (what ``subprocess.run(timeout=)`` does to torchrun) hands them to the pytest process,
which kills what is left when a file's tests end."""
import os
import subprocess
import sys
import time

import leftovers
from conftest import LAUNCH_PYTHONPATH, ROOT, alive


def test_a_killed_launchers_child_comes_to_pytest_and_is_killed_at_the_files_end():
    launcher = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    orphan = int(launcher.stdout.readline())
    launcher.kill()  # as subprocess.run's timeout does: the launcher alone
    launcher.wait()
    launcher.stdout.close()
    deadline = time.monotonic() + 10
    # until it is ours and has exec'd sleep (the shell forks, then execs)
    while leftovers.children(os.getpid()).get(orphan, (None, None))[1] != "sleep 300" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers.children(os.getpid()).get(orphan, (None, None))[1] == "sleep 300", \
        "the orphan did not come to the pytest process (not its subreaper)"
    assert alive(orphan)
    assert leftovers.reap_leftovers("this test") == ["sleep 300"]
    assert not alive(orphan) and orphan not in leftovers.children(os.getpid())


# a launcher as bpslaunch starts its children (bps_gc/launcher/spawn.py: parent death signal)
SPAWNING_LAUNCHER = """
import os, sys, time
from bps_gc.launcher.spawn import spawn
print(spawn(["sleep", "300"], dict(os.environ)).pid, flush=True)
time.sleep(300)
"""


def test_a_child_dying_with_its_killed_launcher_is_not_named():
    """A file's last test kills a bpslaunch and the guard runs at once: the launcher's child has
    its parent death signal pending but may not have died yet (9 of 20 times on this box). It is
    not a leftover: the guard waits for it instead of naming it."""
    for _ in range(8):
        launcher = subprocess.Popen([sys.executable, "-c", SPAWNING_LAUNCHER], stdout=subprocess.PIPE, text=True,
                                    env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
        child = int(launcher.stdout.readline())
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
        assert leftovers.reap_leftovers("this test") == []
        assert not alive(child) and child not in leftovers.children(os.getpid())


LEAVER = '''
import subprocess


def test_leaves_an_orphan():
    launcher = subprocess.Popen(["sh", "-c", "exec 1>&-; sleep 300 & echo $! > orphan.pid; wait"])
    while True:  # until the orphan's pid is written and it is sleep (the shell's fork execs it)
        try:
            pid = open("orphan.pid").read().strip()
            if pid and open(f"/proc/{pid}/comm").read().strip() == "sleep":
                break
        except OSError:
            pass
    launcher.kill()
    launcher.wait()
'''


def test_a_file_that_leaves_a_process_is_named_in_the_summary_and_the_process_killed(tmp_path):
    """The whole path, in a pytest of its own on tests/conftest.py: a test file whose launcher is
    killed under its child ends with that child killed and a LeftoverProcesses warning naming it
    in the run's summary."""
    (tmp_path / "test_leaver.py").write_text(LEAVER)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                             "test_leaver.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    orphan = int((tmp_path / "orphan.pid").read_text())
    assert "LeftoverProcesses" in result.stdout and "test_leaver left 1 process(es) running, killed: sleep 300" \
        in result.stdout, result.stdout[-3000:]
    assert not alive(orphan)
