"""scripts/time_to_accuracy.py --task lm --hsdp: the LM yardstick's HSDP rows (issue 42), 2
machines x --local-ranks ranks (>= 2), the GPT sharded with FSDP2 over each machine's ranks
(example/pytorch/lm/hsdp.py) and replicated across the machines: native HSDP (fully_shard on
the 2-D mesh: FSDP2's dense all-reduce of the gradient shards across the machines) and
bps_gc.torch.register_fsdp_hooks on mesh["replicate"] with thc 4-bit, PowerSGD rank 4 and
top-k 1% + error feedback (with --rows naming them, also PowerSGD r8 and r16, thc 8-bit and
"PowerSGD r4|r8 after 30|60 dense": register_fsdp_hooks' dense_steps; "HSDP + DiLoCo dense|thc
4-bit": bps_gc.torch.DiLoCo across the machines over the model sharded in each, with the LM
rows' --diloco-* flags, evaluated on the replica's parameters). In network namespaces
(--shaped RATE) a machine's ranks talk over its loopback, unshaped (FSDP2's in-host all-gather
and reduce-scatter), and the machines over their NICs, shaped to RATE.

First THE LIMIT trains --steps steps sharded on mesh["shard"] with nothing across the machines
(each machine its own model: only its step time counts, the in-host work of the job's four
processes on this box's cores). Then native HSDP trains --steps steps: the target is its final
validation loss + --slack, and the cap --cap-factor x its time to the target. Each hook row
trains --steps steps and on at the schedule's last rate until it reaches the target or the cap
(at most 10 x --steps). All ranks evaluate (an FSDP forward is collective) every --eval-every
steps with the clock stopped; rank 0's loss counts. Bytes per rank per step are what a rank
hands the cross-machine exchange: bps.metrics()'s pushed bytes for the hooks; native HSDP's
padded gradient shards (its replicate all-reduce at 2 machines sends that much each way).
"""
import math
import os
import statistics
import sys
import time

import time_to_accuracy_lm as lm

THC = {"compressor": "thc", "bits": 4, "feedback": True}
HOOKS = {"HSDP hooks thc 4-bit": THC,
         "HSDP hooks PowerSGD r4": {"compressor": "powersgd", "rank": 4},
         "HSDP hooks topk 1% + EF": {"compressor": "topk", "k": 0.01, "ef": "vanilla"}}
# issue 42's time target: a higher rank, more bits, a dense start; run only when --rows names them
MORE_HOOKS = {"HSDP hooks PowerSGD r8": {"compressor": "powersgd", "rank": 8},
              "HSDP hooks PowerSGD r16": {"compressor": "powersgd", "rank": 16},
              "HSDP hooks thc 8-bit": {**THC, "bits": 8}}
# "<hook row> after N dense": its first N steps averaged dense (register_fsdp_hooks' dense_steps)
DENSE_FIRST = tuple(f"HSDP hooks PowerSGD r{r} after {n} dense" for r in (4, 8) for n in (30, 60))
# DiLoCo across the machines over the model sharded in each (no hooks: nothing crosses the
# machines between syncs; docs/diloco.md "A sharded model inside each replica"), at
# --diloco-every and its warm phase and outer lr flags; run only when --rows names them
DILOCO = ("HSDP + DiLoCo dense", "HSDP + DiLoCo thc 4-bit")
NATIVE = "native HSDP"
LIMIT = "the limit (no cross-host exchange)"


def dense_steps(config):
    """A hook row's dense steps before its codec: the number before " dense" in its name, else 0."""
    return int(config.rsplit(" ", 2)[1]) if config.endswith(" dense") else 0


def rows(wanted):
    """The run's configurations: the limit and native HSDP, then the hook rows ``wanted`` keeps."""
    named = not wanted("")  # --rows given
    return (LIMIT, NATIVE, *(name for name in HOOKS if wanted(name)),
            *(name for name in (*MORE_HOOKS, *DENSE_FIRST, *DILOCO) if named and wanted(name)))


class Rank:
    """One rank's side: time_to_accuracy_lm.Run's corpus, batches and collectives, a mesh."""

    def __init__(self, args):
        from hsdp import mesh_for
        self.run = lm.Run(args)
        self.args, self.torch = args, self.run.torch
        self.mesh = mesh_for(args.local_ranks)

    def model(self, config):
        """(model, optimizer, bytes a synced step hands the cross-host exchange or None: counted,
        a dense-first row's dense steps too: metrics() counts them)."""
        from hsdp import padded_shard_bytes, shard_gpt
        from lm_training import build_model, make_optimizer
        model = build_model(self.args, self.run.device)
        diloco = config in DILOCO
        how = "none" if diloco else {LIMIT: "none", NATIVE: "native"}.get(config, "hooks")
        shard_gpt(model, self.mesh, how, {**HOOKS, **MORE_HOOKS}.get(config.split(" after ")[0]),
                  dense_steps(config) if how == "hooks" else 0)
        fixed = None if diloco else {"none": 0, "native": padded_shard_bytes(model)}.get(how)
        opt = make_optimizer(self.args, model)
        if diloco:  # the scripts' DiLoCo settings (tta_lm_diloco.py), F = 1, across mesh["replicate"]
            from tta_lm_diloco import DILOCO as SETTINGS, make_diloco
            opt = make_diloco(self.run.bps, model, opt, self.args, SETTINGS[config.split("DiLoCo ")[1]],
                              replicate=self.mesh["replicate"].get_group())
        return model, opt, fixed

    def loss(self, model):
        """Rank 0's validation loss on every rank (every rank runs the FSDP forward)."""
        from lm_training import evaluate
        mine = evaluate(model, self.run.val, self.run.device, self.run.amp)
        return self.run.mean([mine * self.run.size if self.run.rank == 0 else 0.0], "tta.loss")[0]

    def train(self, config, target=None, cap=math.inf):
        """{curve: [(step, seconds, loss)], bytes_per_step, capped}; without ``target`` exactly
        --steps steps."""
        import bps_gc.core
        from gpt import byte_loss
        from lm_training import clipped_step
        args, run = self.args, self.run
        model, opt, fixed = self.model(config)
        curve, clock, capped, reached, sent = [(0, 0.0, self.loss(model))], 0.0, False, False, 0
        step_seconds = []
        run.bps.barrier()
        bps_gc.core.metrics()  # reset
        for step in range(args.steps if target is None else lm.MAX_STEPS_FACTOR * args.steps):
            began = time.perf_counter()
            run.set_lr(opt, args, step)
            x, y = run.batch(run.rank, step)
            opt.zero_grad()
            byte_loss(model(x), y).backward()
            clipped_step(opt, model, args.clip, synchronizes=False)
            step_seconds.append(time.perf_counter() - began)
            clock += step_seconds[-1]
            done = step + 1
            if done % args.eval_every and done != args.steps:
                continue
            sent += bps_gc.core.metrics().pushed_wire
            clock = run.mean([clock])[0]
            loss = self.loss(model)
            bps_gc.core.metrics()  # the evaluation's collectives are not the training's exchange
            curve.append((done, clock, loss))
            if target is None:
                continue
            reached = reached or loss <= target
            if clock > cap and not (reached and done >= args.steps):
                capped = True
                break
            if reached and done >= args.steps:
                break
        steps = curve[-1][0]
        sent = fixed * steps if fixed is not None else sent
        # the median step: the first steps' warm-up and the other jobs' bursts are not the step's cost
        median, per_step = run.mean([statistics.median(step_seconds), sent / max(steps, 1)], "tta.bytes")
        return {"curve": curve, "bytes_per_step": per_step, "capped": capped, "median_step_seconds": median}


def seconds_to(curve, target):
    return next(((s, t) for s, t, loss in curve if loss <= target and s > 0), (None, None))


def rank_main(args):
    """The limit, native HSDP (which sets the target and the cap), then the hook rows."""
    import json
    rank = Rank(args)
    out = {"rows": {}}
    for config in args.configs.split(","):
        if config in (LIMIT, NATIVE):
            row = rank.train(config)
            if config == NATIVE:
                target = row["curve"][-1][2] + args.slack
                cap = args.cap_factor * seconds_to(row["curve"], target)[1]
        else:
            row = rank.train(config, target, cap)
        out["rows"][config] = row
        if rank.run.rank == 0:
            print(f"{config}: {row['curve'][-1][1]:.1f} s, step {row['curve'][-1][0]}, val loss "
                  f"{row['curve'][-1][2]:.4f}{' (capped)' if row['capped'] else ''}", flush=True)
    if rank.run.rank == 0:
        json.dump(out, open(args.rank_out, "w"))
    rank.run.bps.shutdown()


def table(args, results):
    """{row: {...}} and the run's facts (target, native's seconds to it, cap, the limit's step)."""
    rows_in = results["rows"]
    target = rows_in[NATIVE]["curve"][-1][2] + args.slack
    native_seconds = seconds_to(rows_in[NATIVE]["curve"], target)[1]
    limit_ms = 1000 * rows_in[LIMIT]["median_step_seconds"]
    rate = parse_rate(args)
    rows = {}
    for name, r in rows_in.items():
        steps, seconds = seconds_to(r["curve"], target) if name != LIMIT else (None, None)
        at_steps = [(s, loss) for s, _, loss in r["curve"] if s <= args.steps][-1]
        ms = 1000 * r["curve"][-1][1] / r["curve"][-1][0]
        # a machine's ranks share its NIC: each hands the link its bytes
        link = 8000 * r["bytes_per_step"] * args.local_ranks / rate if rate else None
        cpu = ms - limit_ms - (link or 0)
        rows[name] = {"seconds_to_target": seconds, "vs_native": seconds / native_seconds if seconds else None,
                      "steps_to_target": steps, "bytes_per_rank_step": r["bytes_per_step"],
                      "final_val_loss": at_steps[1], "steps_done": at_steps[0], "capped": r["capped"],
                      "stopped_at_step": r["curve"][-1][0], "loss_when_stopped": r["curve"][-1][2],
                      "seconds": r["curve"][-1][1], "ms_per_step": ms, "link_ms": link, "cpu_ms": cpu,
                      "bound": None if name == LIMIT or not rate else "link" if link >= cpu else "CPUs"}
    return rows, {"target": target, "native_seconds_to_target": native_seconds,
                  "cap_seconds": args.cap_factor * native_seconds, "limit_ms_per_step": limit_ms}


def parse_rate(args):
    from bench_common import import_netns
    return import_netns().parse_rate(args.shaped) if args.shaped else None


def print_table(rows, info, args):
    print(f"target: native HSDP's val loss + {args.slack} = {info['target']:.4f} nats/byte "
          f"({info['target'] / math.log(2):.3f} bits), reached in {info['native_seconds_to_target']:.1f} s; "
          f"cap {info['cap_seconds']:.1f} s; the limit's step {info['limit_ms_per_step']:.1f} ms (its median)")
    print(f"{'':34} {'s to target':>11} {'x native':>8} {'steps':>6} {'bytes/rank/step':>15} "
          f"{'val loss @ steps':>17} {'stopped: loss @ step':>20} {'ms/step':>7} {'link ms':>7} {'CPU ms':>7} bound")
    for name, r in rows.items():
        t = (f"{r['seconds_to_target']:11.1f}" if r["seconds_to_target"] is not None else
             f"{'-' if name == LIMIT else '> cap' if r['capped'] else 'never':>11}")
        ratio = f"{r['vs_native']:7.2f}x" if r["vs_native"] else f"{'-':>8}"
        steps = f"{r['steps_to_target']:6d}" if r["steps_to_target"] else f"{'-':>6}"
        link = f"{r['link_ms']:7.1f}" if r["link_ms"] is not None else f"{'-':>7}"
        cpu = f"{r['cpu_ms']:7.1f}" if name != LIMIT else f"{'-':>7}"
        print(f"{name:34} {t} {ratio} {steps} {r['bytes_per_rank_step']:15,.0f} "
              f"{r['final_val_loss']:9.4f} @ {r['steps_done']:<5d} {r['loss_when_stopped']:12.4f} @ "
              f"{r['stopped_at_step']:<5d} {r['ms_per_step']:7.1f} {link} {cpu} {r['bound'] or '-'}")
    print(f"link ms: a rank's bytes x {args.local_ranks} ranks sharing a machine's NIC at the shaped rate; "
          "CPU ms: ms/step - the limit's step - link ms (codec work, warm-up, the processes sharing the cores); "
          "bound: the larger of the two. The limit's step is the job's in-host work alone: "
          f"{args.local_ranks * 2} processes on {os.cpu_count()} cores")


def report(args, results, where):
    """Print the table, write the JSON and the plot (time_to_accuracy.py's save)."""
    from bench_common import machine_info
    from time_to_accuracy import MACHINES, ranks_of, save
    rows, info = table(args, results)
    print(f"{ranks_of(args)}, HSDP (shards: a machine's {args.local_ranks} ranks), {where}; {machine_info()}; "
          f"{args.steps} steps of {args.batch_size} x {args.context} bytes per rank; model {args.layers} layers "
          f"x {args.width}")
    print_table(rows, info, args)
    summary = {"task": "lm", "hsdp": True, **info, "link": where, "command": sys.argv, "machines": MACHINES,
               "local_ranks": args.local_ranks, "machine": machine_info(), "steps": args.steps,
               "model": {k: getattr(args, k) for k in ("layers", "width", "heads", "context", "batch_size")},
               "rows": rows, "curves": {name: r["curve"] for name, r in results["rows"].items()}}
    series = {name: ([t for _, t, _ in r["curve"]], [loss for _, _, loss in r["curve"]])
              for name, r in results["rows"].items() if name != LIMIT}
    save(args, summary, series, info["target"], "validation loss (nats per byte)")
