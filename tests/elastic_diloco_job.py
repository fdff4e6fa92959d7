"""A worker host of the elastic DiLoCo test (tests/test_elastic_diloco.py): bps_gc.torch.DiLoCo
with the outer step on the servers under BPS_GC_ELASTIC, the small MLP of test_diloco.py, inner
SGD on each rank's own batches. Each exchange's pseudo-gradient (recorded as DiLoCo makes it,
numbered by the exchanges started: one fragment's each) and global copy after its outer step
are saved, with bps.size() at each; at the end the global copy pulled from the servers
(DiLoCo.global_parameters()). The ``victim`` rank stops at inner step ``kill_at``
(mid-window), says HALF and waits to be killed; a joiner starts where DiLoCo.elastic_start puts
it. Every worker stops ``after_join`` windows of H inner steps (as many exchanges) into
membership epoch ``join_epoch`` (from its first exchange: a joiner's, the join's), or after
``max_rounds`` windows, or at the window written in ``stop_file`` once it exists. With ``gate``
(a path) the members idle in membership epoch 1 (after a death) until it exists (a joiner says
JOINING first). ``replicate``, ``fragments``, ``delay``: the DiLoCo's of both phases (with
"hosts" a host's local ranks train on the host's batches: one replica). ``parameters``: the
model's parameters after each outer step are saved too.
With ``workers_phase`` the live hosts then train a fresh model with the outer step on the
workers in the same job (saved under ``w/``; its own ``sync_every``, ``fragments``, ``delay``,
``warm_steps``, ``warm_every``, ``after_join``;
``pause_at``: the members sleep after those inner steps only): the first phase's joiner stops
at the phase's ``kill_at`` (HALF again), and a host started with ``workers_joiner`` (which skips
the first phase) joins it; they stop ``after_join`` windows into epoch ``join_epoch``. Its
``gate`` (a path) and ``gate_at`` (an inner step): the members idle after that inner step until
the path exists (the test makes it once the scheduler logged the join's start: the join's first
exchange is then the first one started after that step, by construction).
With ``save_each_round`` each push is on disk before it is sent (scripts/elastic_netns.py kills
a host at any moment: the oracle needs every round it pushed).
Run as ``python tests/elastic_diloco_job.py SPEC.json OUT_DIR``."""
import json
import os
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]
import bps_gc.core as core  # noqa: E402
import bps_gc.torch as bps  # noqa: E402
from elastic_host import say  # noqa: E402
from test_diloco import batch, build_model  # noqa: E402

spec, out_dir = json.load(open(sys.argv[1])), sys.argv[2]
bps.init()
rank = bps.rank()
# with replicate="hosts" a host's local ranks are one replica: the same batches (identical steps)
replica = rank // bps.local_size() if spec.get("replicate") == "hosts" else rank
H = spec["sync_every"]
saved = {}


class Recorded(bps.DiLoCo):
    tag = ""  # "w/": the workers' outer step phase
    started = 0  # exchanges started so far (a joiner: before its first), each numbered by it
    join_epoch, first_joined, last = None, None, None  # the stop rule's (train())
    first = 0  # this host's first exchange (a joiner's: the join's)

    def start_sync(self, *fragments):  # the pseudo-gradients this worker pushes, for the oracle
        # every exchange before this one waited for (DiLoCo does so first under BPS_GC_ELASTIC),
        # none after it pushed: membership_epoch() is the previous exchange's epoch on every rank
        # alike (read once an exchange is finished, a later one's release could race it)
        self.wait()
        joined = self.started - 1  # the first exchange of the join's epoch (a joiner's: its first)
        if self.first_joined is None and joined >= self.first and bps.membership_epoch() >= self.join_epoch:
            self.first_joined = joined
        for fragment in fragments:  # a warm step's: every fragment's, one exchange each
            fragment.index, rnd = self.started, self.started
            self.started += 1
            for (name, p), copy in zip(fragment.named, fragment.copies):
                saved[f"{self.tag}pseudo/{rnd}/{name}"] = (copy - p.detach().float()).numpy().copy()
            saved[f"{self.tag}size/{rnd}"] = np.array(bps.size())
        if spec.get("save_each_round"):
            keep(f"rank{rank}.{start}.npz")
        super().start_sync(*fragments)

    def finish_sync(self, fragment):  # the global copy after each exchange's outer step
        super().finish_sync(fragment)
        for name, copy in zip(fragment.names, fragment.copies):
            saved[f"{self.tag}global/{fragment.index}/{name}"] = copy.numpy().copy()
        for name, p in fragment.named if spec.get("parameters") else ():  # the model's, after it
            saved[f"{self.tag}param/{fragment.index}/{name}"] = p.detach().numpy().copy()
        if self.first_joined is not None and fragment.index >= self.first_joined + self.last:
            self.done = True


def keep(name):
    """``saved`` in OUT_DIR/``name``, whole or not at all (a kill may come at any moment)."""
    np.savez(os.path.join(out_dir, name + ".tmp.npz"), start=start, **saved)
    os.replace(os.path.join(out_dir, name + ".tmp.npz"), os.path.join(out_dir, name))


def train(opt, model, join_epoch, after_join, victim_at=None, pause_at=None, gate=None, gate_at=None):
    """Inner steps until ``after_join`` windows of H inner steps (as many exchanges as that
    holds) into membership epoch ``join_epoch``, counted from its first exchange; at inner step
    ``victim_at``: save, say HALF, wait to be killed. The sleep between inner steps: ``sleep``
    after each, or with ``pause_at``, H times it after the inner steps that are ``pause_at`` mod H.
    Until the path ``gate`` exists: idle in membership epoch 1, or with ``gate_at`` after that inner step."""
    H = opt.sync_every
    opt.join_epoch, opt.last, opt.done = join_epoch, after_join * len(opt.fragments) - 1, False
    while opt.steps < spec["max_rounds"] * H and not opt.done:
        if opt.steps == victim_at:
            keep(f"rank{rank}.{'victim' if not opt.tag else start}.npz")  # its pushes, for the oracle
            say("HALF")
            time.sleep(600)  # killed here
        while gate and (bps.membership_epoch() == 1 if gate_at is None else opt.steps == gate_at) and \
                not os.path.exists(gate):
            time.sleep(0.05)  # the members idle while a joiner starts (its python and torch: seconds)
        x, y = batch(replica, opt.steps)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if opt.steps % H == 0:
            rnd = opt.steps // H - 1
            say(f"ROUND {opt.tag}{rnd} {bps.size()} {bps.membership_epoch()}")
            if spec.get("stop_file") and os.path.exists(spec["stop_file"]) and \
                    rnd >= int(open(spec["stop_file"]).read()):
                break
        time.sleep(spec["sleep"] if pause_at is None else H * spec["sleep"] * (opt.steps % H == pause_at))
    opt.wait()


def landed(opt):
    """A joiner's exchange in flight at its join (the one before its first, applied at its due
    step): numbered as such; saved: its due step, if any."""
    for fragment in [f for f in opt.fragments if f.pending is not None]:
        fragment.index = opt.started - 1
    saved[f"{opt.tag}landed"] = np.array([f.due for f in opt.fragments if f.pending is not None])


model = build_model()
opt = Recorded(model, torch.optim.SGD(model.parameters(), lr=0.05), H, fragments=spec.get("fragments", 1),
               delay=spec.get("delay", 0), compression_params=spec["compression_params"],
               outer_step=spec.get("outer_step"), replicate=spec.get("replicate"))  # None: the default (servers)
if opt.hosts:  # the parameters whose outer step the workers take (the servers': those sent uncompressed)
    saved["on_workers"] = np.array(sorted(opt.exchange.averaged if opt.on_servers else dict(model.named_parameters())))
workers_joiner = spec.get("workers_joiner", False)  # joins in the workers' phase: skips the first
if core.joining() and not workers_joiner:
    say("JOINING")  # made, about to ask to join (the members' ``gate`` may open)
start = opt.started = opt.first = 0 if workers_joiner else opt.elastic_start()
if not workers_joiner:
    landed(opt)
    say(f"START {start} {opt.steps}")
    train(opt, model, spec["join_epoch"], spec["after_join"],
          spec["kill_at"] if replica == spec["victim"] and not start else None, spec.get("pause_at"), spec.get("gate"))
    if opt.on_servers:
        saved.update({f"pulled/{name}": t.numpy().copy() for name, t in opt.global_parameters().items()})
    keep(f"rank{rank}.{start}.npz")
if spec.get("workers_phase"):  # DiLoCo with the outer step on the workers, in the same job
    phase = spec["workers_phase"]
    model = build_model()
    opt = Recorded(model, torch.optim.SGD(model.parameters(), lr=0.05), phase.get("sync_every", H),
                   fragments=phase.get("fragments", 1), delay=phase.get("delay", 0),
                   warm_steps=phase.get("warm_steps", 0), warm_every=phase.get("warm_every"),
                   compression_params=spec["compression_params"], outer_step="workers",
                   replicate=spec.get("replicate"))
    opt.tag = "w/"
    opt.started = opt.first = opt.elastic_start()
    saved["w/start"] = np.array(opt.started)
    landed(opt)
    say(f"START w/{int(saved['w/start'])} {opt.steps} in flight {saved['w/landed'].tolist()}")
    train(opt, model, phase["join_epoch"], phase.get("after_join", spec["after_join"]),
          phase["kill_at"] if replica == spec["victim"] and start and not workers_joiner else None,
          phase.get("pause_at"), phase.get("gate"), phase.get("gate_at"))
    keep(f"rank{rank}.{'w' + str(int(saved['w/start'])) if workers_joiner else start}.npz")
say("DONE")
bps.shutdown()
