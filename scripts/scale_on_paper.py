#!/usr/bin/env python3
"""Scale on paper: the bytes through each host's NIC and the messages per round of one
push_pull of every ResNet-50 gradient (tests/data/resnet50_shapes.json), on H hosts x L ranks,
counted without a network from bps_gc's own partitioning, placement, fusion, codecs, reducers
and wire headers.

Designs (docs/scale.md says what each models):
  ps-colocated-flat / ps-separate-flat: today's parameter server, every rank pushes its copy;
    co-located: --colocated-servers (2) per worker host (BytePS's recipe: 16 servers, 8 hosts),
    server s on host s % H; separate: --separate-servers (1) machines per worker host.
  ps-colocated-2level / ps-separate-2level: the parameter server's two levels
    (BPS_GC_HIERARCHY=host, docs/local_ranks.md; counted here with partition_owner, its rule):
    the host's ranks reduce-scatter in shared memory, each partition's owner
    ((tensor index + partition index) mod L) compresses the host's sum once and pushes it.
  ring-flat / ring-2level: torch.distributed (gloo/NCCL ring) over N = H*L ranks, or within the
    host then L rings of H hosts; codecs go as the collective transport carries them (all_gather
    of payloads, majority and PowerSGD as all_reduce), in BPS_GC_BUCKET_BYTES buckets.
  gossip-ring / gossip-torus: CHOCO-SGD (a codec as Q) or D-PSGD (dense), one message per rank
    per neighbour per round, ranks host-major on the graph.

    PYTHONPATH=$PWD python scripts/scale_on_paper.py [--hosts 8,16,...] [--local 8]
        [--codecs dense,...] [--json out/scale_on_paper.json] [--png docs/img/scale_bytes.png]
        [--markdown]    (BYTEPS_PARTITION_BYTES, BPS_GC_*_BYTES are read as a worker reads them)
"""
import argparse
import json
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from bps_gc import compress  # noqa: E402
from bps_gc.config import Config, ConfigError  # noqa: E402
from bps_gc.comm.phased import phase_dtype, phase_lengths, phase_names, phases  # noqa: E402
WORDS = np.dtype(np.int64)  # the words torch.distributed sums thc's lanes in (collective/reductions.py)
from bps_gc.ps.worker.push import Push, fusable, fusion_buckets  # noqa: E402
from bps_gc.comm.placement import partition_owner  # noqa: E402
from bps_gc.comm.placement import Placement, declare_tensor, dense_partition_bytes  # noqa: E402
from bps_gc.wire.wire import encode_context, pack_fused  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_on_paper_gossip import gossip_counts  # noqa: E402
from scale_on_paper_report import markdown, nic_ms, plot, print_table, summary  # noqa: E402
from scale_on_paper_sizes import (CONTEXT, GRADIENT_STD, MEASURED_PUSHES, PUSH_HEADER,  # noqa: E402
                                  REPLY_HEADER, Sizes, variable)

SHAPES_FILE = os.path.join(ROOT, "tests", "data", "resnet50_shapes.json")
MODEL = "resnet50_v1b"
HOSTS = (8, 16, 32, 64, 128, 256, 512, 1024)
LOCAL = 8
CODECS = {
    "dense": {},
    "onebit+scaling": {"compressor": "onebit", "scaling": True},
    "topk 0.1%": {"compressor": "topk", "k": 0.001},
    "randomk 0.1%": {"compressor": "randomk", "k": 0.001},
    "dithering k=2": {"compressor": "dithering", "k": 2},
    "terngrad": {"compressor": "terngrad"},
    "qsgd 4 levels": {"compressor": "qsgd", "levels": 4},
    "threshold 3e-3": {"compressor": "threshold", "threshold": 3e-3},
    "signnorm": {"compressor": "signnorm"},
    "dgc 0.1%": {"compressor": "dgc", "k": 0.001},
    "powersgd rank 1": {"compressor": "powersgd", "rank": 1},
    "powersgd rank 4": {"compressor": "powersgd", "rank": 4},
    "thc 4-bit": {"compressor": "thc", "bits": 4},
    "thc 2-bit": {"compressor": "thc", "bits": 2},
}
SUMMARY = (("dense", "sum"), ("onebit+scaling", "recompress"), ("topk 0.1%", "recompress"),
           ("powersgd rank 4", "powersgd"), ("thc 4-bit", "thc"))
PHASED = ("powersgd", "thc")  # codecs whose phases are plain sums (no gossip Q of one shot)
PS_DESIGNS = ("ps-colocated-flat", "ps-colocated-2level", "ps-separate-flat", "ps-separate-2level")
RING_DESIGNS = ("ring-flat", "ring-2level")
GOSSIP_DESIGNS = ("gossip-ring", "gossip-torus")
MULTI_HOST_BOOK = {"servers": [{"address": "10.0.0.1:9000"}], "workers": [{"address": "10.0.0.2:9000"}]}


def load_shapes(path=SHAPES_FILE, model=MODEL):
    with open(path) as f:
        return [tuple(s) for s in json.load(f)[model]]


def worker_settings(environ=None):
    """A worker's Config from this environment (BYTEPS_PARTITION_BYTES, BPS_GC_*), as a job
    spanning hosts would read it."""
    env = dict(os.environ if environ is None else environ)
    env.update({"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_WORKER_ID": "0",
                "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9000"})
    return Config.from_env(env, role="worker")



def plan(shapes, params, reducer, num_servers, cfg, summands=1):
    """The worker's tensors, declared and placed by the real code (comm.placement.Placement;
    a two-phase tensor's phase buffers, sized for sums of ``summands`` pushes (thc's lanes),
    declared after it as dense auxiliaries, as ps/worker/worker.py ``_place`` does). Returns
    [TensorPlan]."""
    tensors = {}
    placement = Placement(num_servers, cfg.partition_bytes, cfg.min_compress_bytes,
                          dense_partition_bytes(cfg, MULTI_HOST_BOOK))
    codecs = {}

    def build_codec(tensor, n, dtype, key):  # sizes need one chain per (size, shape)
        where = (n, tensor.shape)
        if where not in codecs:
            codecs[where] = (compress.build_chain(tensor.params, n, dtype, key=key, shape=tensor.shape),
                             compress.make_reducer(tensor.reducer, tensor.params, n, dtype, key))
        return codecs[where]

    for i, shape in enumerate(shapes):
        tensor, shape, dtype = declare_tensor(tensors, compress, f"grad{i}", shape, np.float32,
                                              reducer, params)
        placement.plan(tensor, shape, dtype, build_codec, balanced=True)
        if phases(tensor) > 1:
            for name, length in zip(phase_names(tensor), phase_lengths(tensor, summands)):
                aux, aux_shape, aux_dtype = declare_tensor(tensors, compress, name, (length,),
                                                           phase_dtype(tensor), None, {})
                placement.plan(aux, aux_shape, aux_dtype, build_codec, balanced=True)
                aux.auxiliary = True
    return list(tensors.values())


def owner(tensor, part, local):
    """Two levels: the local rank that pushes ``part`` for its host (the worker's own rule)."""
    return partition_owner(tensor.index, part.key & 0xFFFF, local)


def messages(tensors, sizes, scale, pushes, cfg, local=1):
    """The PUSH messages of one round and their replies, as ps/worker/io.py sends them: compressed
    and large dense partitions alone, small dense ones FUSED per server (every fusable push of
    the round in one fusion window: the fewest messages). With ``local`` > 1 (two-level) each
    partition is pushed once, by its owner, whose pushes fuse among themselves.
    Returns numpy arrays (server, push bytes, reply bytes) per message and the reply kinds."""
    parts = [(t, p) for t in tensors if phases(t) == 1 for p in t.partitions]
    out, how = [], set()
    for rank in range(local):
        alone, fused, reply_of = [], [], {}
        for tensor, part in parts:
            if owner(tensor, part, local) != rank:
                continue
            if tensor.compressed:
                nbytes = sizes.push(tensor.params.to_dict(), part.n, tensor.shape, scale)
                reply, kind = sizes.reply(tensor.params.to_dict(), tensor.reducer, part.n, tensor.shape,
                                          scale, pushes)
                how.add(kind)
                payload, dest = np.empty(nbytes, np.uint8), None
            else:
                reply = part.n * tensor.wire_dtype.itemsize
                payload = np.empty(reply, np.uint8)
                dest = payload
            push = Push(None, part, payload, tensor.compressed, encode_context(CONTEXT), 0,
                        tensor.wire_dtype, dest)
            reply_of[id(push)] = reply
            (fused if fusable(push, cfg.fusion_bytes) else alone).append(push)
        for push in alone:
            out.append((push.part.server, PUSH_HEADER + push.nbytes, REPLY_HEADER + reply_of[id(push)]))
        for bucket in fusion_buckets(fused, cfg.fusion_bytes):
            if len(bucket) == 1:
                push = bucket[0]
                out.append((push.part.server, PUSH_HEADER + push.nbytes, REPLY_HEADER + reply_of[id(push)]))
                continue
            entries = [(p.part.key, 0, p.payload) for p in bucket]
            replies = [(p.part.key, 0, np.empty(reply_of[id(p)], np.uint8)) for p in bucket]
            out.append((bucket[0].part.server, PUSH_HEADER + len(pack_fused(entries)),
                        REPLY_HEADER + len(pack_fused(replies))))
    arr = np.array(out, np.int64).reshape(-1, 3)
    return arr[:, 0], arr[:, 1], arr[:, 2], how


def ps_counts(design, hosts, local, tensors_for, sizes, cfg, servers_per_host=(2, 1)):
    """Per-round NIC counts of a parameter-server design on ``hosts`` x ``local`` ranks;
    ``servers_per_host``: (co-located servers on each worker host, separate server machines
    per worker host)."""
    colocated, two_level = "colocated" in design, design.endswith("2level")
    per_host = servers_per_host[0] if colocated else servers_per_host[1]
    num_servers = max(1, round(per_host * hosts))
    copies = 1 if two_level else local  # pushes per partition per host
    pushes = hosts * copies  # pushes a server sums per partition
    scale = GRADIENT_STD * math.sqrt(local) if two_level else GRADIENT_STD  # a host's sum
    server, push, reply, how = messages(tensors_for(num_servers), sizes, scale, pushes, cfg,
                                        local if two_level else 1)
    srv_in = np.bincount(server, weights=push, minlength=num_servers)
    srv_out = np.bincount(server, weights=reply, minlength=num_servers)
    srv_msgs = np.bincount(server, minlength=num_servers)
    if colocated:  # pushes and replies within a host stay in shared memory / a unix socket
        host_of = np.arange(num_servers) % hosts
        local_in = np.bincount(host_of, weights=srv_in, minlength=hosts)
        local_out = np.bincount(host_of, weights=srv_out, minlength=hosts)
        local_msgs = np.bincount(host_of, weights=srv_msgs, minlength=hosts)
        remote = pushes - copies  # pushers on other hosts
        out = copies * (push.sum() - local_in) + remote * local_out
        inn = copies * (reply.sum() - local_out) + remote * local_in
        msgs = 2 * copies * (len(push) - local_msgs) + 2 * remote * local_msgs
        busiest = int(np.argmax(np.maximum(out, inn)))
        server_in, server_out = remote * srv_in, remote * srv_out
        fan_in = remote * srv_msgs
    else:
        out = np.full(hosts, copies * push.sum())
        inn = np.full(hosts, copies * reply.sum())
        msgs = np.full(hosts, 2 * copies * len(push))
        busiest = 0
        server_in, server_out, fan_in = pushes * srv_in, pushes * srv_out, pushes * srv_msgs
    top = int(np.argmax(np.maximum(server_in, server_out)))
    return {"out": float(out[busiest]), "in": float(inn[busiest]), "msgs": int(msgs[busiest]),
            "server_in": float(server_in[top]), "server_out": float(server_out[top]),
            "server_fan_in": int(fan_in[top]), "servers_used": int((srv_msgs > 0).sum()),
            "servers": num_servers, "reply": sorted(how)}


def buckets(tensors, bucket_bytes):
    """The collective transport's buckets (collective/buckets.py ``_add``): tensors in
    declaration order, a bucket goes out once its input bytes reach BPS_GC_BUCKET_BYTES."""
    out, current, size = [], [], 0
    for tensor in tensors:
        current.append(tensor)
        size += tensor.size * tensor.wire_dtype.itemsize
        if size >= bucket_bytes:
            out.append(current)
            current, size = [], 0
    return out + ([current] if current else [])


def ring_counts(design, hosts, local, tensors, sizes, cfg):
    """A ring's per-round NIC counts. Ranks are host-major, so a flat ring of N = H*L ranks
    crosses each host's NIC on one edge out and one in; ring-2level reduces within the host
    first and runs L rings of H hosts, one per 1/L share (NCCL's hierarchical all_reduce).
    Per ring of R members: all_reduce sends 2(R-1)/R of the buffer in 2(R-1) messages,
    all_gather (R-1) payloads in R-1 messages (gloo's and NCCL's ring schedules)."""
    two_level = design.endswith("2level")
    ranks, rings = (hosts, local) if two_level else (hosts * local, 1)
    scale = GRADIENT_STD * math.sqrt(local) if two_level else GRADIENT_STD
    sent, msgs, how = 0.0, 0, set()
    tensors = [t for t in tensors if not t.auxiliary]

    def all_reduce(nbytes):
        return 2 * (ranks - 1) / ranks * nbytes, 2 * (ranks - 1) * rings

    def all_gather(nbytes):  # every member's payload goes to every other member
        return (ranks - 1) * nbytes, (ranks - 1) * rings
    for bucket in buckets(tensors, cfg.bucket_bytes):
        dense = sum(t.size * 4 for t in bucket if not t.compressed)
        coded, phased = [], []
        for t in bucket:
            if not t.compressed:
                continue
            if phases(t) > 1:  # PowerSGD: one all_reduce per phase over the bucket
                phased.append(t)
            elif t.reducer == "majority":  # int32 votes, all_reduced per tensor, at once
                b, m = all_reduce((t.size + 1) * 4)
                sent, msgs = sent + b, msgs + m
            else:
                coded.append(t)
        # thc's lanes: one summand per rank flat, per host with two levels (comm/phased.py host_first),
        # in torch.distributed's int64 words (collective/reductions.py WORDS)
        for part_bytes in ([dense] if dense else []) + [sum(phase_lengths(t, ranks, WORDS)[i] * phase_dtype(t).itemsize
                                                            for t in phased) for i in range(2) if phased]:
            b, m = all_reduce(part_bytes)
            sent, msgs = sent + b, msgs + m
        if coded:  # lengths (int64 per partition), then the payloads padded to the longest rank
            count = sum(len(t.partitions) for t in coded)
            payload = 0
            for t in coded:
                for part in t.partitions:
                    payload += sizes.push(t.params.to_dict(), part.n, t.shape, scale)
                    how.add("held" if variable(t.params.to_dict()) else "exact")
            for nbytes in (8 * count, payload):
                b, m = all_gather(nbytes / rings)  # two-level: each share's ring gathers its share
                sent, msgs = sent + b * rings, msgs + m
    return {"out": sent, "in": sent, "msgs": 2 * msgs, "reply": sorted(how)}


def reducers_of(params):
    """The reducers a codec supports (its default first); 'sum' for dense."""
    if not params:
        return ["sum"]
    from bps_gc.compress.registry import COMPRESSORS
    return list(COMPRESSORS[params["compressor"]].reducers)


def count_all(hosts=HOSTS, local=LOCAL, codecs=CODECS, designs=PS_DESIGNS + RING_DESIGNS + GOSSIP_DESIGNS,
              shapes=None, sizes=None, cfg=None, servers_per_host=(2, 1)):
    """Every (design, codec, reducer, hosts) row as a dict of per-round counts (bytes)."""
    shapes = load_shapes() if shapes is None else shapes
    sizes, cfg = sizes or Sizes(), cfg or worker_settings()
    plans, rows = {}, []

    def tensors_for(params, reducer, summands):
        summands = summands if params.get("compressor") == "thc" else 1  # only thc's sizes depend on it
        def of(num_servers):  # noqa: E306
            key = (json.dumps(params, sort_keys=True), reducer, num_servers, summands)
            if key not in plans:
                plans[key] = plan(shapes, params, None if reducer == "sum" else reducer, num_servers, cfg,
                                  summands)
            return plans[key]
        return of
    for design in designs:
        for codec, params in codecs.items():
            for reducer in reducers_of(params):
                if design.startswith("gossip") and (reducer != reducers_of(params)[0]
                                                    or params.get("compressor") in PHASED):
                    continue  # gossip: Q's payload, no reducer; PowerSGD and thc are no one-shot Q
                if design.startswith("ring") and reducer == "lossless":
                    continue  # the collective gathers payloads: each rank reduces them itself
                for h in hosts:
                    summands = h if design.endswith("2level") else h * local  # thc: the host sums first
                    if design.startswith("ps"):
                        counts = ps_counts(design, h, local, tensors_for(params, reducer, summands), sizes, cfg,
                                           servers_per_host)
                    elif design.startswith("ring"):
                        counts = ring_counts(design, h, local, tensors_for(params, reducer, summands)(1), sizes, cfg)
                    else:
                        counts = gossip_counts(design, h, local, shapes, params, sizes)
                    shown = "Q" if design.startswith("gossip") and params else reducer
                    rows.append({"design": design, "codec": codec, "reducer": shown, "hosts": h,
                                 "local": local, **counts})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default=",".join(map(str, HOSTS)))
    p.add_argument("--local", type=int, default=LOCAL, help="ranks per host")
    p.add_argument("--colocated-servers", type=int, default=2,
                   help="servers on each worker host (BytePS's recipe: 16 for 8 hosts)")
    p.add_argument("--separate-servers", type=float, default=1.0,
                   help="server machines per worker host for the separate designs")
    p.add_argument("--codecs", default=None, help="comma-separated subset of: " + ", ".join(CODECS).replace("%", "%%"))
    p.add_argument("--json", default=os.path.join("out", "scale_on_paper.json"))
    p.add_argument("--png", default=os.path.join("docs", "img", "scale_bytes.png"))
    p.add_argument("--markdown", action="store_true", help="also print docs/scale.md's tables")
    args = p.parse_args()
    try:
        hosts = [int(h) for h in args.hosts.split(",")]
    except ValueError:
        p.error(f"--hosts {args.hosts!r}: expected comma-separated host counts, e.g. 8,64")
    unknown = [c for c in (args.codecs or "").split(",") if c and c not in CODECS]
    if unknown or min(hosts) < 1 or args.local < 1:
        p.error(f"unknown codec(s) {unknown} (known: {', '.join(CODECS)})" if unknown
                else "--hosts and --local must be positive")
    if args.colocated_servers < 1 or args.separate_servers <= 0:
        p.error("--colocated-servers must be >= 1 and --separate-servers > 0")
    codecs = CODECS if not args.codecs else {c: CODECS[c] for c in args.codecs.split(",")}
    try:
        cfg = worker_settings()
    except ConfigError as e:
        p.error(str(e))
    shapes = load_shapes()
    print(f"{MODEL}: {len(shapes)} tensors, {sum(int(np.prod(s)) for s in shapes) * 4 / 1e6:.1f} MB float32; "
          f"BYTEPS_PARTITION_BYTES {cfg.partition_bytes:,}, dense partitions "
          f"{dense_partition_bytes(cfg, MULTI_HOST_BOOK):,}, BYTEPS_MIN_COMPRESS_BYTES {cfg.min_compress_bytes:,}, "
          f"BPS_GC_FUSION_BYTES {cfg.fusion_bytes:,}, BPS_GC_BUCKET_BYTES {cfg.bucket_bytes:,}; "
          f"headers: push {PUSH_HEADER} B, reply/peer {REPLY_HEADER} B")
    print(f"servers: {args.colocated_servers} per worker host co-located (server s on host s % H), "
          f"{args.separate_servers:g} machine(s) per worker host separate; {args.local} ranks per host")
    rows = count_all(hosts, args.local, codecs, shapes=shapes, cfg=cfg,
                     servers_per_host=(args.colocated_servers, args.separate_servers))
    for row in rows:
        row["ms_100g"], row["ms_25g"] = nic_ms(row, 100), nic_ms(row, 25)
    print_table(rows, hosts)
    if args.markdown:
        print(summary(rows, hosts, SUMMARY))
        print(markdown(rows, [h for h in hosts if h in (8, 64, 1024)] or hosts,
                       PS_DESIGNS + RING_DESIGNS + GOSSIP_DESIGNS))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"model": MODEL, "local": args.local, "hosts": hosts, "settings": {
            "partition_bytes": cfg.partition_bytes, "min_compress_bytes": cfg.min_compress_bytes,
            "dense_partition_bytes": dense_partition_bytes(cfg, MULTI_HOST_BOOK),
            "fusion_bytes": cfg.fusion_bytes, "bucket_bytes": cfg.bucket_bytes,
            "colocated_servers_per_host": args.colocated_servers,
            "separate_servers_per_host": args.separate_servers, "gradient_std": GRADIENT_STD,
            "measured_pushes": MEASURED_PUSHES}, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")
    if args.png:
        plot(rows, args.png, [("dense", "sum"), ("topk 0.1%", "recompress"), ("onebit+scaling", "recompress")])


if __name__ == "__main__":
    main()
