"""scripts/scale_on_paper.py against hand counts made here with numpy from the shapes file:
partition sizes, greedy placement by bytes, wire headers (38-byte struct + the push's step
context), fusion's index, codec payload formats of docs/codecs.md, ring and gossip traffic."""
import dataclasses
import json
import math
import os

import numpy as np
import pytest

from conftest import DATA, ROOT, LAUNCH_PYTHONPATH, load_script

paper = load_script(os.path.join(ROOT, "scripts", "scale_on_paper.py"))

SHAPES = [tuple(s) for s in json.load(open(os.path.join(DATA, "resnet50_shapes.json")))["resnet50_v1b"]]
SIZES = np.array([int(np.prod(s)) for s in SHAPES])
HEADER = 38  # "<4sBBBBiQQQH"
PUSH_HEADER = HEADER + 1 + sum(1 + len(name) + 9 for name in ("lr", "step", "epoch"))
DENSE_PART = 1_024_000 // 4  # floats per dense partition of a job spanning hosts
L = 2  # ranks per host


def settings(**changes):
    return dataclasses.replace(paper.worker_settings({}), **changes)


def dense_parts(sizes):
    """Element counts of every dense partition, in declaration order."""
    return [min(DENSE_PART, n - start) for n in sizes for start in range(0, n, DENSE_PART)]


def greedy(parts, servers):
    load = np.zeros(servers, np.int64)
    where = []
    for n in parts:
        s = int(np.argmin(load))  # lowest index on ties
        load[s] += 4 * n
        where.append(s)
    return np.array(where)


def count(design, hosts, shapes=SHAPES, codec="dense", cfg=None):
    rows = paper.count_all([hosts], L, {codec: paper.CODECS[codec]}, [design], shapes,
                           paper.Sizes(), cfg or settings(fusion_bytes=0))
    return rows


@pytest.mark.parametrize("two_level", [False, True])
def test_parameter_server_dense_without_fusion(two_level):
    """2 hosts x 2 ranks: every partition alone; separate servers see every push, co-located
    ones keep their own host's pushes off the NIC."""
    parts = np.array(dense_parts(SIZES))
    copies = 1 if two_level else L
    total = 4 * parts.sum()
    assert total == 4 * SIZES.sum() and len(parts) > len(SHAPES)
    suffix = "2level" if two_level else "flat"
    (sep,) = count(f"ps-separate-{suffix}", 2)
    assert sep["out"] == copies * (total + PUSH_HEADER * len(parts))
    assert sep["in"] == copies * (total + HEADER * len(parts))
    assert sep["msgs"] == 2 * copies * len(parts)
    where = greedy(parts, 2)
    on0 = where == 0
    assert sep["server_in"] == max(2 * copies * (4 * parts[w].sum() + PUSH_HEADER * w.sum()) for w in (on0, ~on0))
    (co,) = count(f"ps-colocated-{suffix}", 2)
    server = greedy(parts, 4)
    local = server % 2 == 0  # host 0 holds servers 0 and 2
    best = []
    for mine in (local, ~local):
        theirs = ~mine
        out = copies * (4 * parts[theirs].sum() + PUSH_HEADER * theirs.sum()) \
            + copies * (4 * parts[mine].sum() + HEADER * mine.sum())  # replies to the other host
        inn = copies * (4 * parts[theirs].sum() + HEADER * theirs.sum()) \
            + copies * (4 * parts[mine].sum() + PUSH_HEADER * mine.sum())
        best.append((max(out, inn), out, inn, 2 * copies * len(parts)))
    _, out, inn, msgs = max(best, key=lambda b: b[0])  # the first host on a tie, as the script
    assert (co["out"], co["in"], co["msgs"]) == (out, inn, msgs)


def test_fusion_counts_one_message_per_server():
    """Small dense tensors share one FUSED message (uint32 count + 24 bytes per entry)."""
    shapes = [(10,), (20, 3), (7,), (300_000,)]  # the last one: two partitions, alone
    (row,) = count("ps-separate-flat", 1, shapes, cfg=settings())  # one host: one server
    small = 4 * (10 + 60 + 7)
    fused_push = PUSH_HEADER + 4 + 24 * 3 + small
    fused_reply = HEADER + 4 + 24 * 3 + small
    assert row["out"] == L * (fused_push + 2 * PUSH_HEADER + 4 * 300_000)
    assert row["in"] == L * (fused_reply + 2 * HEADER + 4 * 300_000)
    assert row["msgs"] == L * 2 * 3
    # two-level: partition p of tensor i is pushed by local rank (i + p) mod 2: rank 0 the 10,
    # the 7 and the 44,000 (tensor 3's second partition), rank 1 the 60 and the 256,000; each
    # fuses only its own small pushes
    (row,) = count("ps-separate-2level", 1, shapes, cfg=settings())
    assert row["out"] == (PUSH_HEADER + 4 + 24 * 2 + 4 * 17) + 3 * PUSH_HEADER + 4 * (60 + 300_000)
    assert row["msgs"] == 2 * 4


def test_onebit_majority_two_level_payload_sizes():
    """onebit: ceil(n/32) uint32 words + a float32 scale per partition of at least 64 KB (4 MB
    partitions); the majority reply ceil(n/8) bytes + 1; smaller tensors go dense, unfused."""
    shapes = [(64,), (256, 64, 1, 1), (2048, 1000), (64, 64, 3, 3)]
    sizes = np.array([int(np.prod(s)) for s in shapes])
    per = 4_096_000 // 4
    comp = [min(per, n - s) for n in sizes if 4 * n >= 65_536 for s in range(0, n, per)]
    dense = [n for n in sizes if 4 * n < 65_536]
    pushes = sum(math.ceil(n / 32) * 4 + 4 for n in comp) + 4 * sum(dense)
    replies = sum(math.ceil(n / 8) + 1 for n in comp) + 4 * sum(dense)
    msgs = len(comp) + len(dense)
    rows = paper.count_all([2], L, {"onebit+scaling": paper.CODECS["onebit+scaling"]}, ["ps-separate-2level"],
                           shapes, paper.Sizes(), settings(fusion_bytes=0))
    (row,) = [r for r in rows if r["reducer"] == "majority"]
    assert row["out"] == pushes + PUSH_HEADER * msgs
    assert row["in"] == replies + HEADER * msgs
    assert row["reply"] == ["exact"]


def test_ring_and_gossip_dense():
    """Ring: 2(R-1)/R of the model crosses each host (R = 4 ranks flat, 2 hosts two-level),
    2(R-1) messages per BPS_GC_BUCKET_BYTES bucket per ring; gossip on a ring of 4 ranks: each
    host has two cross-host edges, each carrying the packed model (uint32 count and lengths)."""
    nbytes = 4 * SIZES
    buckets, size = 0, 0
    for b in nbytes:  # a bucket goes out once it holds 25 MiB of input
        size += b
        if size >= 25 << 20:
            buckets, size = buckets + 1, 0
    buckets += size > 0
    (flat,) = count("ring-flat", 2)
    (two,) = count("ring-2level", 2)
    assert flat["out"] == pytest.approx(2 * 3 / 4 * nbytes.sum())
    assert two["out"] == pytest.approx(2 * 1 / 2 * nbytes.sum())
    assert flat["msgs"] == 2 * buckets * 2 * 3
    assert two["msgs"] == 2 * buckets * 2 * 1 * L
    (ring,) = count("gossip-ring", 2)
    message = HEADER + 4 + 4 * len(SHAPES) + nbytes.sum()
    assert (ring["out"], ring["in"], ring["msgs"]) == (2 * message, 2 * message, 4)


def test_collective_gathers_onebit_payloads():
    """The collective carries a codec as an all_gather of every rank's payloads (after one of
    their lengths, int64 per partition) and all_reduces the uncompressed tensors: on a flat
    ring of 4 ranks each host's NIC carries 3 of each, and 2 * 3/4 of the dense bytes."""
    shapes = [(64,), (256, 64, 1, 1), (2048, 1000), (64, 64, 3, 3)]  # one bucket
    sizes = np.array([int(np.prod(s)) for s in shapes])
    per = 4_096_000 // 4
    comp = [min(per, n - s) for n in sizes if 4 * n >= 65_536 for s in range(0, n, per)]
    dense = 4 * sum(n for n in sizes if 4 * n < 65_536)
    payload = sum(math.ceil(n / 32) * 4 + 4 for n in comp)
    (row,) = [r for r in paper.count_all([2], L, {"onebit+scaling": paper.CODECS["onebit+scaling"]},
                                         ["ring-flat"], shapes, paper.Sizes(), settings())
              if r["reducer"] == "recompress"]
    assert row["out"] == pytest.approx(3 * 8 * len(comp) + 3 * payload + 2 * 3 / 4 * dense)
    assert row["msgs"] == 2 * (2 * 3 + 3 + 3)


def test_command_line_writes_table_json_and_plot(tmp_path):
    """The script end to end at 2 hosts, dense: the printed table, the JSON, the PNG."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "scale_on_paper.py"), "--hosts", "2",
                          "--codecs", "dense", "--json", str(tmp_path / "s.json"), "--png",
                          str(tmp_path / "s.png"), "--markdown"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=LAUNCH_PYTHONPATH))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.load(open(tmp_path / "s.json"))["rows"]
    assert {r["design"] for r in rows} == set(paper.PS_DESIGNS + paper.RING_DESIGNS + paper.GOSSIP_DESIGNS)
    sep = next(r for r in rows if r["design"] == "ps-separate-2level")
    parts = len(dense_parts(SIZES))
    assert 0 < sep["out"] - 4 * SIZES.sum() < (PUSH_HEADER + 28) * parts  # headers, fused indexes
    assert sep["msgs"] < 2 * parts  # small tensors fused: fewer messages than partitions
    assert "ps-separate-2level" in out.stdout and (tmp_path / "s.png").stat().st_size > 10_000
