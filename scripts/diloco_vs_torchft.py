#!/usr/bin/env python3
"""bps_gc.torch.DiLoCo against torchft's DiLoCo (PyPI torchft 0.2.0) in the same run (issue 44).

Two replicas, two gloo processes under torchrun. In each case both implementations train the
same 4-layer MLP (same init, same per-replica batches, same inner AdamW) with the paper's outer
Nesterov SGD (lr 0.7, momentum 0.9) for ``--rounds`` windows of H inner steps, torchft's through
its lighthouse and a Manager per replica (its own gloo group), ours through bps_gc's exchange on
the torchrun group. The table gives, per case, the largest relative difference of a parameter
between the two after the run (per tensor, max |ours - torchft| / max |torchft|, the worst tensor
of either replica), whether they agree bit for bit, how far the run moved the parameters (the
same measure against the initial ones) and each side's wall time for its training loop.

The schedules, read from both sources (torchft/local_sgd.py, bps_gc/torch/diloco.py), with
F fragments and delay tau:
* torchft syncs fragment ``manager step % F`` every H/F inner steps: it starts the fragment's
  allreduce (pseudo-gradient taken then) tau steps *before* the H/F-th step and applies the
  outer step and the alpha merge at it; the j-th sync is applied after inner step j*H/F.
* bps_gc starts fragment f's exchange after the inner steps t with t mod H = (f+1)H/F and
  applies it tau steps *after* (the Streaming DiLoCo paper's send at t_p, receive at t_p + tau).
With tau = 0 the two are the same schedule. With tau > 0, bps_gc's is torchft's shifted tau
steps later, so the case "...(bps_gc's phase)" differs by definition; the case "...(torchft's
phase)" starts bps_gc's step counter at tau (a checkpoint's counter, loaded through
``load_state_dict``), which puts every start and every outer step on torchft's inner steps.

    .venv/bin/python scripts/diloco_vs_torchft.py                    # every case, 4 rounds of H=8
    .venv/bin/python scripts/diloco_vs_torchft.py --cases F=1 --rounds 2 --json out/x.json

Needs torchft: ``BPS_GC_EXTRAS=torchft ./scripts/setup_env.sh`` (never part of ``pip install .``).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
from bench_common import pythonpath  # noqa: E402

# name: (fragments, delay tau, alpha, bps_gc's step counter starts at tau: torchft's phase)
CASES = {
    "F=1": (1, 0, 0.0, False),
    "F=2": (2, 0, 0.0, False),
    "F=2 alpha=0.5": (2, 0, 0.5, False),
    "F=2 tau=1 alpha=0.5 (torchft's phase)": (2, 1, 0.5, True),
    "F=2 tau=1 alpha=0.5 (bps_gc's phase)": (2, 1, 0.5, False),
    "F=4 tau=1 alpha=0.5 (torchft's phase)": (4, 1, 0.5, True),
}
WIDTH = (16, 32, 32, 32, 8)  # the MLP's sizes, input to output: four Linear layers, up to 4 fragments
TARGET = 1e-6


def build_model():
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(WIDTH, WIDTH[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, WIDTH[0], generator=g), torch.randn(8, WIDTH[-1], generator=g)


def inner_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def outer_optimizer(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def torchft_fragments(model, fragments):
    """The model's Linear layers in F contiguous groups: the fragments bps_gc cuts (by parameter
    count, in order), as the modules torchft's DiLoCo takes."""
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    cuts = [len(layers) * f // fragments for f in range(fragments + 1)]
    return [torch.nn.ModuleList(layers[cuts[f]:cuts[f + 1]]) for f in range(fragments)]


def train(model, opt_step, zero_grad, rank, steps):
    start = time.perf_counter()
    for step in range(steps):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt_step()
        zero_grad()
    return time.perf_counter() - start


def run_torchft(make_manager, rank, steps, sync_every, fragments, delay, alpha):
    """torchft's DiLoCo with a fresh Manager (a Manager takes one DiLoCo's state functions, and
    its step, which picks the fragment, starts at 0)."""
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo
    manager = make_manager()
    model = build_model()
    inner = inner_optimizer(model)
    parts = torchft_fragments(model, fragments)
    outers = [outer_optimizer(list(part.parameters())) for part in parts]
    # the first quorum, outside the timed loop: it waits for the last case's managers to leave
    # the lighthouse and connects the gloo group (ours is connected before its loop too); DiLoCo
    # asks for the same quorum at its first sync
    manager.start_quorum()
    manager.wait_quorum()
    try:
        with TorchftDiLoCo(manager, parts, inner, outers, sync_every=sync_every, fragment_sync_delay=delay,
                           fragment_update_alpha=alpha):
            seconds = train(model, inner.step, inner.zero_grad, rank, steps)
    finally:
        manager.shutdown(wait=True)
    return model, seconds


def run_ours(rank, steps, sync_every, fragments, delay, alpha, torchft_phase):
    import bps_gc.torch as bps
    model = build_model()
    opt = bps.DiLoCo(model, inner_optimizer(model), sync_every, outer_optimizer=outer_optimizer,
                     fragments=fragments, delay=delay, alpha=alpha)
    if torchft_phase:  # as if resumed tau steps into the window: starts land tau steps earlier
        saved = opt.state_dict()
        saved["steps"] = delay
        opt.load_state_dict(saved)
    seconds = train(model, opt.step, opt.zero_grad, rank, steps)
    opt.wait()  # an exchange still in flight (bps_gc's phase): done before teardown
    return model, seconds


def worker(spec_path, out):
    """One replica: every case with torchft's DiLoCo, then with bps_gc's."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    spec = json.load(open(spec_path))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # this replica group's
    timeout = timedelta(seconds=60)

    def make_manager():
        return Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                       min_replica_size=2, use_async_quorum=False, init_sync=False, replica_id=f"replica_{rank}",
                       store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                       lighthouse_addr=spec["lighthouse"], timeout=timeout, quorum_timeout=timeout,
                       connect_timeout=timeout)
    saved, seconds = {}, {}
    steps = spec["rounds"] * spec["sync_every"]
    for case, (fragments, delay, alpha, torchft_phase) in spec["cases"].items():
        model, seconds[f"{case}/torchft"] = run_torchft(make_manager, rank, steps, spec["sync_every"], fragments,
                                                        delay, alpha)
        saved.update({f"{case}/torchft/{n}": p.detach().numpy().copy() for n, p in model.named_parameters()})
        dist.barrier()
        model, seconds[f"{case}/bps_gc"] = run_ours(rank, steps, spec["sync_every"], fragments, delay, alpha,
                                                    torchft_phase)
        saved.update({f"{case}/bps_gc/{n}": p.detach().numpy().copy() for n, p in model.named_parameters()})
        dist.barrier()
    saved.update({f"init/{n}": p.detach().numpy().copy() for n, p in build_model().named_parameters()})
    np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)
    json.dump(seconds, open(os.path.join(out, f"seconds{rank}.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


def relative(got, want):
    """Per tensor max |got - want| / max |want|; the worst tensor."""
    return max(float(np.max(np.abs(got[n] - want[n])) / np.max(np.abs(want[n]))) for n in want)


def compare(args, results, seconds):
    rows = []
    for case, (fragments, delay, alpha, torchft_phase) in args.cases.items():
        diffs, moved, identical = [], [], True
        for rank_results in results:
            pick = {side: {k.rsplit("/", 1)[1]: v for k, v in rank_results.items() if k.startswith(f"{case}/{side}/")}
                    for side in ("torchft", "bps_gc")}
            init = {k[len("init/"):]: v for k, v in rank_results.items() if k.startswith("init/")}
            diffs.append(relative(pick["bps_gc"], pick["torchft"]))
            moved.append(relative(pick["torchft"], init))
            identical &= all(pick["bps_gc"][n].tobytes() == pick["torchft"][n].tobytes() for n in init)
        comparable = delay == 0 or torchft_phase
        rows.append({"case": case, "fragments": fragments, "delay": delay, "alpha": alpha,
                     "bps_gc_counter_starts_at": delay if torchft_phase else 0, "same_schedule": comparable,
                     "max_relative_difference": max(diffs), "bit_identical": identical,
                     "moved_from_init": min(moved),
                     "torchft_seconds": max(s[f"{case}/torchft"] for s in seconds),
                     "bps_gc_seconds": max(s[f"{case}/bps_gc"] for s in seconds),
                     "within_target": comparable and max(diffs) <= TARGET})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of: {'; '.join(CASES)} (default: all)")
    parser.add_argument("--rounds", type=int, default=4, help="outer rounds (windows of H inner steps)")
    parser.add_argument("--sync-every", type=int, default=8, help="H, inner steps per round")
    parser.add_argument("--json", default=os.path.join(ROOT, "out", "diloco_vs_torchft.json"))
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        raise SystemExit(f"diloco_vs_torchft: unknown case {unknown[0]!r}; the cases: {'; '.join(CASES)}")
    args.cases = {c: CASES[c] for c in args.cases.split(",")}
    if args.rounds < 1:
        raise SystemExit(f"diloco_vs_torchft: --rounds must be at least 1, got {args.rounds}")
    for case, (fragments, delay, _, _) in args.cases.items():  # torchft's own rules (ours are looser)
        if args.sync_every % fragments or delay >= args.sync_every // fragments:
            raise SystemExit(f"diloco_vs_torchft: case {case!r} needs --sync-every a multiple of {fragments} "
                             f"and above {fragments} x {delay}, got {args.sync_every}")
    os.environ.setdefault("RUST_LOG", "error")  # torchft's lighthouse logs every quorum otherwise
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as e:
        raise SystemExit(f"diloco_vs_torchft: torchft is not importable ({e}); install the extra: "
                         "BPS_GC_EXTRAS=torchft ./scripts/setup_env.sh")
    from bench_common import machine_info

    load_before = os.getloadavg()[0]
    # a shut-down case's managers leave the lighthouse after 1 s without heartbeats (default 5 s)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, heartbeat_timeout_ms=1000)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"lighthouse": lighthouse.address(), "rounds": args.rounds, "sync_every": args.sync_every,
                    "cases": args.cases}
            json.dump(spec, open(os.path.join(tmp, "spec.json"), "w"))
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    os.path.abspath(__file__), "--worker", os.path.join(tmp, "spec.json"), tmp]
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath(ROOT, HERE))
            job = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
            if job.returncode != 0:
                raise SystemExit(f"diloco_vs_torchft: the job failed ({job.returncode}):\n{job.stderr[-4000:]}")
            results = [dict(np.load(os.path.join(tmp, f"rank{r}.npz"))) for r in range(2)]
            seconds = [json.load(open(os.path.join(tmp, f"seconds{r}.json"))) for r in range(2)]
    finally:
        lighthouse.shutdown()
    rows = compare(args, results, seconds)
    from importlib.metadata import version
    report = {"machine": machine_info(), "load_average_before": round(load_before, 2),
              "load_average_after": round(os.getloadavg()[0], 2), "replicas": 2, "rounds": args.rounds,
              "sync_every": args.sync_every, "model": f"MLP {'-'.join(map(str, WIDTH))} (tanh)",
              "inner": "AdamW lr 1e-3 wd 0.1", "outer": "SGD lr 0.7 momentum 0.9 nesterov",
              "torch": torch.__version__, "torchft": version("torchft"), "target": TARGET, "rows": rows}
    print(f"{report['machine']}; load average {report['load_average_before']} before, "
          f"{report['load_average_after']} after; torch {report['torch']}, torchft {report['torchft']}")
    print(f"2 replicas (gloo), {report['model']}, inner {report['inner']}, outer {report['outer']}, "
          f"H={args.sync_every}, {args.rounds} rounds")
    print(f"{'case':40s} {'same schedule':>13s} {'max rel diff':>12s} {'bits equal':>10s} {'moved':>8s} "
          f"{'torchft s':>9s} {'bps_gc s':>8s}")
    for r in rows:
        print(f"{r['case']:40s} {'yes' if r['same_schedule'] else 'no':>13s} {r['max_relative_difference']:12.2e} "
              f"{'yes' if r['bit_identical'] else 'no':>10s} {r['moved_from_init']:8.3f} "
              f"{r['torchft_seconds']:9.3f} {r['bps_gc_seconds']:8.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    json.dump(report, open(args.json, "w"), indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
