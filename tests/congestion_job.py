"""A worker of tests/test_congestion.py: push_pull once over TCP, then record the congestion
control of each connection between this worker and the servers: its own ends (from its
sockets) and the servers' ends (from ``ss``; None without it). Writes OUT.<rank>."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bps_gc.core as bps  # noqa: E402
from tcp_links import own_tcp_connections  # noqa: E402

bps.init()
bps.declare("grad", shape=(300_000,), dtype="float32")
out = bps.push_pull(np.ones(300_000, np.float32), "grad", average=False).wait()
assert np.all(out == bps.size())
server_ports = {int(s["address"].rpartition(":")[2]) for s in bps.worker().io.servers}
mine = {(a, b): cc for (a, b), cc in own_tcp_connections().items() if b in server_ports}
theirs = None
if shutil.which("ss"):
    text = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True).stdout
    # a connection is a line "recv-q send-q local peer", then an indented line opening with its algorithm
    found = re.findall(r"^\S+\s+\S+\s+\S+:(\d+)\s+\S+:(\d+)\s*\n\s+(\w+)", text, re.M)
    my_ports = {a for a, _ in mine}
    theirs = {f"{a}>{b}": cc for a, b, cc in found if int(a) in server_ports and int(b) in my_ports}
json.dump({"worker_ends": {f"{a}>{b}": cc for (a, b), cc in mine.items()}, "server_ends": theirs},
          open(f"{sys.argv[1]}.{bps.rank()}", "w"))
bps.barrier()
bps.shutdown()
