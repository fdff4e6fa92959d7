"""The suite's own guard against orphans (tests/leftovers.py): a launcher killed under its
children (what ``subprocess.run(timeout=)`` does to torchrun) hands them to the pytest process,
which kills what is left when a file's tests end."""
import os
import subprocess
import time

import leftovers
from conftest import alive


def test_a_killed_launchers_child_comes_to_pytest_and_is_killed_at_the_files_end():
    launcher = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    orphan = int(launcher.stdout.readline())
    launcher.kill()  # as subprocess.run's timeout does: the launcher alone
    launcher.wait()
    launcher.stdout.close()
    deadline = time.monotonic() + 10
    while orphan not in leftovers.children(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers.children(os.getpid()).get(orphan, (None, None))[1] == "sleep 300", \
        "the orphan did not come to the pytest process (not its subreaper)"
    assert alive(orphan)
    assert leftovers.reap_leftovers("this test") == ["sleep 300"]
    assert not alive(orphan) and orphan not in leftovers.children(os.getpid())
