#!/usr/bin/env python3
"""DiLoCo's bytes per inner step against DDP dense's (issue 44's bytes target: thc 4-bit at
H = 100 sends at most 1/500 of DDP dense's bytes per step).

Two replicas train the LM yardstick's reduced GPT (scripts/time_to_accuracy_lm.py; 2 layers x
64, context 64, tied output layer) with bps_gc.torch.DiLoCo: inner AdamW (lr 3e-3), the
default outer Nesterov SGD, one fragment, no delay, for ``--steps`` inner steps (a multiple of
every H, so each run ends on a sync). Each configuration starts from the same weights; the data
are random bytes (the codecs' sizes here do not depend on the values). Bytes per inner step are
the LM yardstick's "bytes per rank per step": what a rank pushes, counted by bps_gc.torch.metrics()
(pushed_wire: the exchange's payloads and thc's phases on torch.distributed, the pushes on the
parameter server), reset just before the run, divided by the inner steps, the largest of the two
ranks; DDP dense's is its whole gradient, 4 bytes x parameters, every step (what its reducer
all-reduces; the yardstick's definition).

Transports: "collective", torchrun with 2 gloo ranks (CompressedExchange); "ps", bpslaunch
--local with 2 workers and 1 server (PushPullExchange), with BYTEPS_MIN_COMPRESS_BYTES=0, so
every tensor is compressed, as the yardstick's parameter-server rows run.

    .venv/bin/python scripts/diloco_bytes.py                       # both transports, H = 100 and 50
    .venv/bin/python scripts/diloco_bytes.py --transports collective --codecs "thc 4-bit" --sync-every 100
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LM = os.path.join(ROOT, "example", "pytorch", "lm")
sys.path[:0] = [ROOT, HERE, LM]
from bench_common import pythonpath  # noqa: E402

CODECS = {"dense": None,
          "thc 4-bit": {"compressor": "thc", "bits": 4},
          "onebit+EF": {"compressor": "onebit", "scaling": True, "ef": "vanilla"}}
TRANSPORTS = ("collective", "ps")
TARGET = ("thc 4-bit", 100, 1 / 500)  # codec, H, the largest ratio to DDP dense's bytes per step
MODEL = {"layers": 2, "width": 64, "heads": 4, "context": 64}


def worker(spec_path, out):
    """One replica: every (codec, H) of the spec in turn; writes OUT/rank<r>.json."""
    import torch

    import bps_gc.torch as bps
    from gpt import GPT, byte_loss
    spec = json.load(open(spec_path))
    torch.set_num_threads(1)
    if spec["transport"] == "ps":
        bps.init()
        rank, barrier = bps.rank(), bps.barrier
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, barrier = dist.get_rank(), dist.barrier
    rows = []
    for codec, sync_every in spec["runs"]:
        torch.manual_seed(spec["seed"])
        model = GPT(**MODEL)
        opt = bps.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=3e-3), sync_every,
                         compression_params=CODECS[codec])
        data = torch.Generator().manual_seed(1000 * spec["seed"] + rank)
        barrier()
        bps.metrics()  # reset: only this run's exchanges count
        for _ in range(spec["steps"]):
            tokens = torch.randint(0, 256, (spec["batch_size"], MODEL["context"] + 1), generator=data)
            byte_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        counted = bps.metrics()  # the last sync's outer step waited for its exchange: all counted
        rows.append({"codec": codec, "sync_every": sync_every, "pushed_wire": counted.pushed_wire,
                     "pulled_wire": counted.pulled_wire, "parameters": sum(p.numel() for p in model.parameters()),
                     "tensors": len(list(model.parameters()))})
        opt.wait()  # an exchange in flight finished before the next run and the shutdown
        del opt
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    if spec["transport"] == "ps":
        bps.shutdown()
    else:
        barrier()
        torch.distributed.destroy_process_group()


def launch(transport, spec, tmp):
    """Both replicas' rows (rank 0's, rank 1's) of one transport's job."""
    spec_path = os.path.join(tmp, f"{transport}.json")
    out = os.path.join(tmp, transport)
    os.makedirs(out)
    with open(spec_path, "w") as f:
        json.dump({**spec, "transport": transport}, f)
    job = [os.path.abspath(__file__), "--worker", spec_path, out]
    if transport == "collective":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *job]
    else:
        argv = [sys.executable, "-m", "bps_gc.launcher.cli", "--local", "--workers", "2", "--servers", "1", "--",
                sys.executable, *job]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT, HERE, LM),
               BYTEPS_MIN_COMPRESS_BYTES="0", BPS_GC_TRANSPORT=transport)
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"diloco_bytes: the {transport} job failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def table(transport, ranks, steps):
    """Rows with bytes per inner step (the larger rank's) and their ratio to DDP dense's."""
    parameters = ranks[0][0]["parameters"]
    ddp = 4 * parameters
    rows = [{"transport": transport, "codec": "DDP dense (every step)", "sync_every": 1, "syncs": steps,
             "bytes_per_inner_step": ddp, "ratio_to_ddp_dense": 1.0, "counted": False, "target": None}]
    for per_rank in zip(*ranks):
        codec, sync_every = per_rank[0]["codec"], per_rank[0]["sync_every"]
        per_step = max(r["pushed_wire"] for r in per_rank) / steps
        target = TARGET[2] if (codec, sync_every) == TARGET[:2] else None
        rows.append({"transport": transport, "codec": codec, "sync_every": sync_every, "syncs": steps // sync_every,
                     "bytes_per_inner_step": per_step, "ratio_to_ddp_dense": per_step / ddp, "counted": True,
                     "pushed_wire_per_rank": [r["pushed_wire"] for r in per_rank], "target": target,
                     "met": None if target is None else 0 < per_step / ddp <= target})
    return rows, parameters, ranks[0][0]["tensors"]


def one_in(ratio):
    return f"1/{1 / ratio:,.0f}" if 0 < ratio < 1 else f"{ratio:g}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated, of: collective, ps")
    p.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated, of: {', '.join(CODECS)}")
    p.add_argument("--sync-every", default="100,50", help="comma-separated H values (inner steps per sync)")
    p.add_argument("--steps", type=int, default=300, help="inner steps of every run (a multiple of every H)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per replica and step (bytes do not "
                                                             "depend on it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=os.path.join(ROOT, "out", "diloco_bytes.json"))
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)
    transports, codecs = args.transports.split(","), args.codecs.split(",")
    for name, chosen, known in (("transport", transports, TRANSPORTS), ("codec", codecs, CODECS)):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            raise SystemExit(f"diloco_bytes: unknown {name} {unknown[0]!r}; the {name}s: {', '.join(known)}")
    try:
        syncs = [int(h) for h in args.sync_every.split(",")]
    except ValueError:
        raise SystemExit(f"diloco_bytes: --sync-every takes whole numbers, got {args.sync_every!r}") from None
    if any(h < 1 or args.steps % h for h in syncs) or args.steps < 1:
        raise SystemExit(f"diloco_bytes: --steps ({args.steps}) must be a positive multiple of every H "
                         f"(--sync-every {args.sync_every})")
    from bench_common import machine_info, write_json_atomic
    load_before = os.getloadavg()[0]
    spec = {"runs": [(c, h) for h in syncs for c in codecs], "steps": args.steps, "batch_size": args.batch_size,
            "seed": args.seed}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for transport in transports:
            got, parameters, tensors = table(transport, launch(transport, spec, tmp), args.steps)
            rows += got
    import torch
    report = {"machine": machine_info(), "load_average_before": round(load_before, 2),
              "load_average_after": round(os.getloadavg()[0], 2), "torch": torch.__version__, "replicas": 2,
              "model": {**MODEL, "parameters": parameters, "tensors": tensors}, "steps": args.steps,
              "batch_size": args.batch_size, "target": {"codec": TARGET[0], "sync_every": TARGET[1],
                                                        "max_ratio": TARGET[2]}, "rows": rows}
    print(f"{report['machine']}; load average {report['load_average_before']} before, "
          f"{report['load_average_after']} after; torch {report['torch']}")
    print(f"2 replicas; GPT {MODEL['layers']} layers x {MODEL['width']} ({parameters:,} parameters, "
          f"{tensors} tensors), inner AdamW, {args.steps} inner steps of {args.batch_size} x {MODEL['context']} random bytes per replica")
    print(f"{'transport':10} {'codec':24} {'H':>4} {'syncs':>5} {'bytes/inner step':>16} {'vs DDP dense':>12} "
          f"{'target':>8} {'met':>4}")
    for r in rows:
        target = f"<= {one_in(r['target'])}" if r["target"] else "-"
        met = "-" if r.get("met") is None else ("yes" if r["met"] else "NO")
        print(f"{r['transport']:10} {r['codec']:24} {r['sync_every']:>4} {r['syncs']:>5} "
              f"{r['bytes_per_inner_step']:>16,.1f} {one_in(r['ratio_to_ddp_dense']):>12} {target:>8} {met:>4}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    write_json_atomic(args.json, report)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
