"""benchmark_synthetic.py's suite: the driver that launches the ranks (torchrun for the DDP and
comm-hook rows, bpslaunch with one server for the parameter-server row), the ranks' side
(benchmark_rows.py's rows, summed over the ranks) and the table.

Images/sec per GPU: the ranks' images/sec summed, over the GPUs they ran on (several ranks
sharing one GPU count once); on the CPU, per process. The codec column is rank 0's; "of step"
is it over the ms per step of the row without communication (the forward, backward and SGD step
the codec adds to).
"""
import json
import os
import subprocess
import sys
import tempfile

# the driver imports no torch (it launches the ranks and reads their results): the ranks' side
# imports it where it is used
from benchmark_row_names import BASELINE, COLLECTIVE_ROWS, PS_ROW, ROWS

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "benchmark_synthetic.py")


def selected_rows(text, parser):
    if not text:
        return list(ROWS)
    rows = [r.strip() for r in text.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        parser.error(f"--rows: unknown {', '.join(unknown) or 'empty list'}; rows: {', '.join(ROWS)}")
    return rows


def rank_main(args, model_fn, device, device_lines, x, y):
    """One rank: the rows, this rank's numbers summed (images/sec) or averaged over the ranks;
    rank 0 writes them to --suite-out."""
    import torch

    import bps_gc.torch as bps
    from benchmark_rows import run_rows
    rank, size = bps.rank(), bps.size()
    results = run_rows(json.loads(args.suite_rows), model_fn, device, x, y, args.num_warmup, args.num_iters,
                       args.codec_repeats)
    for r in results:
        speed, ms = bps.push_pull(torch.tensor([r["images_per_sec"], r["ms_per_step"]], dtype=torch.float64),
                                  average=False, name=f"bench.{r['row']}").tolist()
        r.update(images_per_sec_all_ranks=speed, ms_per_step=ms / size)
        del r["images_per_sec"]
    if rank == 0:
        with open(args.suite_out, "w") as f:
            json.dump({"device": device_lines[-1], "device_type": device.type, "ranks": size,
                       "transport": bps_transport(), "results": results}, f)
    bps.shutdown()
    return 0


def bps_transport():
    from bps_gc.config import transport_from_env
    return transport_from_env()


def rank_argv(args, rows, out):
    """The flags every rank gets: the driver's own, minus the suite's."""
    keep = ["--model", args.model, "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
            "--num-iters", str(args.num_iters), "--num-warmup", str(args.num_warmup), "--device", args.device,
            "--codec-repeats", str(args.codec_repeats), "--suite-rows", json.dumps(rows), "--suite-out", out]
    if args.image_size:
        keep += ["--image-size", str(args.image_size)]
    return keep


def launch(cmd, timeout, what):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "BYTEPS_LOCAL"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    try:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"benchmark_synthetic: the {what} ranks took more than {timeout:g} s (--timeout)")
    if result.returncode != 0:
        tail = (result.stdout + result.stderr)[-3000:]
        sys.exit(f"benchmark_synthetic: the {what} ranks failed (exit {result.returncode}):\n{tail}")
    return result.stdout


def gpus_used(device_type, ranks):
    if device_type != "cuda":
        return ranks  # per process on the CPU
    import torch
    return min(ranks, torch.cuda.device_count())


def drive(args, parser):
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.num_iters < 1 or args.batch_size < 1 or args.num_warmup < 0:
        parser.error("--batch-size and --num-iters must be >= 1, --num-warmup >= 0")
    rows = selected_rows(args.rows, parser)
    py = sys.executable
    parts = []
    with tempfile.TemporaryDirectory(prefix="bps_gc_bench_") as tmp:
        collective = [r for r in rows if r in COLLECTIVE_ROWS]
        if collective:
            out = os.path.join(tmp, "collective.json")
            launch([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks), SCRIPT,
                    *rank_argv(args, collective, out)], args.timeout, "torchrun")
            parts.append(json.load(open(out)))
        if PS_ROW in rows:
            out = os.path.join(tmp, "ps.json")
            launch([py, "-m", "bps_gc.launcher.cli", "--local", "--workers", str(args.ranks), "--servers", "1", "--",
                    py, SCRIPT, *rank_argv(args, [PS_ROW], out)], args.timeout, "bpslaunch")
            parts.append(json.load(open(out)))
    report = summarize(args, parts)
    print_table(report)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def summarize(args, parts):
    results = []
    for part in parts:
        per = gpus_used(part["device_type"], part["ranks"])
        for r in part["results"]:
            results.append(dict(r, transport=part["transport"], images_per_sec_per_gpu=r["images_per_sec_all_ranks"] / per))
    base = next((r["ms_per_step"] for r in results if r["row"] == BASELINE), None)
    for r in results:
        codec = r["codec_ms_per_step"]
        r["codec_fraction_of_step"] = codec / base if codec is not None and base else None
    first = parts[0] if parts else {}
    gpu = None
    if first.get("device_type") == "cuda":
        import torch
        gpu = torch.cuda.get_device_name(0)
    return {"model": args.model, "batch_size": args.batch_size, "ranks": args.ranks, "num_iters": args.num_iters,
            "num_warmup": args.num_warmup, "device": first.get("device"), "gpu": gpu, "torch": torch_version(),
            "command": " ".join([os.path.relpath(SCRIPT), *sys.argv[1:]]), "results": results}


def torch_version():
    """torch's version, from its package metadata where the driver has not imported it."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    from importlib.metadata import version
    return version("torch")


def print_table(report):
    unit = "img/s/GPU" if report["gpu"] else "img/s/proc"
    print(f"model {report['model']}, batch {report['batch_size']} per rank, {report['ranks']} rank(s), "
          f"{report['num_iters']} steps after {report['num_warmup']} warm-up; {report['device']}")
    header = f"{'row':<50} {unit:>11} {'ms/step':>9} {'codec ms':>9} {'of step':>8}"
    print(header)
    print("-" * len(header))
    for r in report["results"]:
        codec = "-" if r["codec_ms_per_step"] is None else f"{r['codec_ms_per_step']:.2f}"
        share = "-" if r["codec_fraction_of_step"] is None else f"{100 * r['codec_fraction_of_step']:.1f}%"
        print(f"{r['row']:<50} {r['images_per_sec_per_gpu']:>11.1f} {r['ms_per_step']:>9.1f} {codec:>9} {share:>8}")
    sys.stdout.flush()
