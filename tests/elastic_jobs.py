"""What the BPS_GC_ELASTIC job tests share (test_elastic.py, test_elastic_join.py): the job's
settings and tensors, its worker hosts' command, and the membership lines every node logs."""
import json
import os
import re
import sys

from multihost import Job

TESTS = os.path.dirname(os.path.abspath(__file__))
# 4 KiB partitions: the dense tensor is split over both servers; every tensor compressed, however small
ENV = {"BPS_GC_ELASTIC": "1", "BYTEPS_PARTITION_BYTES": "4096", "BYTEPS_MIN_COMPRESS_BYTES": "0"}
LINE = re.compile(r"membership: worker ([\d, ]+?) (left|joined); epoch (\d+) from round group (\d+); members \[([\d, ]*)\]")


def two_tensors(dense, signs):
    """A dense float32 tensor of ``dense`` elements and a onebit one with error feedback of ``signs``."""
    return [{"name": "dense", "shape": [dense], "dtype": "float32"},
            {"name": "signs", "shape": [signs], "dtype": "float32", "params": {"compressor": "onebit", "ef": "vanilla"}}]


def host_command(script, spec_path, out):
    """A worker host's command: tests/``script`` SPEC.json OUT."""
    return [sys.executable, os.path.join(TESTS, script), str(spec_path), str(out)]


def start_job(script, spec, tmp_path, workers=3, env=None, **kwargs):
    """The job, one bpslaunch per role, its worker hosts running ``script`` on ``spec`` (written
    to OUT/spec.json); ``env``: besides ENV; ``kwargs``: multihost.Job's."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return Job(workers, None, env=dict(ENV, **(env or {})), command=host_command(script, path, tmp_path), **kwargs)


def membership(text):
    """[(epoch, first group, members)] of the membership lines (left or joined) in a node's log."""
    return [(int(e), int(g), [int(r) for r in m.split(",") if r.strip()]) for _, _, e, g, m in LINE.findall(text)]
