"""One rank refusing states that do not fit, for tests/test_restart_state.py: a phase of
tests/restart_job.py ("state_errors", a 1-rank job on rank 0 of its launch, bps_gc initialised
by the caller). refuse_states(OUT, OTHER_JOBS_CHECKPOINT) writes OUT/errors.json: {check: the
error's text, or what happened}."""
import json
import os

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import bps_gc.core as core
import bps_gc.torch as bps
from bps_gc.compress.stateful import StateError


def refuse_states(out, other_jobs_checkpoint):
    """Trains a hook's and an optimizer's codecs 2 steps, then loads states that do not fit
    (and ``other_jobs_checkpoint``, a 2-rank job's) into this 1-rank job."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.ReLU(), torch.nn.Linear(30, 4))
    base = torch.optim.SGD(net.parameters(), lr=0.1)
    model = DDP(net, bucket_cap_mb=0.001)
    model.register_comm_hook(None, bps.comm_hook({"compressor": "topk", "k": 0.2, "ef": "vanilla"}, optimizer=base,
                                                 named_parameters=net.named_parameters()))
    other = torch.nn.Linear(30, 20)
    opt = bps.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                   named_parameters=other.named_parameters(),
                                   compression_params={"compressor": "randomk", "k": 0.3, "ef": "vanilla"})
    for step in range(2):
        x = torch.randn(4, 8)
        model(x).sum().backward()
        base.step()
        base.zero_grad()
        other(torch.randn(4, 30)).sum().backward()
        opt.step()
        opt.zero_grad()
    sd = bps.state_dict()
    results = {}

    def attempt(check, state, **kwargs):
        before = {k: np.array(v) for k, v in core.state_dict().items()}
        try:
            results[check] = f"loaded: {bps.load_state_dict(state, **kwargs)}"
        except (StateError, ValueError) as e:
            results[check] = f"{type(e).__name__}: {e}"
        after = core.state_dict()
        results[check + " unchanged"] = all(np.array_equal(before[k], np.array(after[k])) for k in before)

    hook_key = next(k for k in sd["objects"] if k.startswith("comm_hook.0/0.weight/"))
    renamed = dict(sd, objects={k.replace("comm_hook.0/0.weight/", "comm_hook.0/encoder.weight/"): v
                                for k, v in sd["objects"].items()})
    attempt("unknown parameter", renamed)
    params_key = next(k for k in sd["objects"] if k.endswith("0.weight/worker/codec.params"))
    other_k = dict(sd, objects=dict(sd["objects"], **{params_key: sd["objects"][params_key].replace("0.2", "0.5")}))
    attempt("another setting", other_k)
    comm_key = next(k for k in sd["communicator"] if k.endswith("ef.error"))
    bad = dict(sd, communicator=dict(sd["communicator"], **{comm_key: sd["communicator"][comm_key][:-1]}),
               objects=dict(sd["objects"], **{hook_key: sd["objects"][hook_key]}))
    attempt("bad communicator array", bad)
    attempt("not a state", {"model": 1})
    attempt("map_location", sd, map_location="cpu")
    saved = bps.load_checkpoint(other_jobs_checkpoint)["bps_gc"]
    attempt("world size", saved)
    attempt("world size dropped", saved, drop_rank_state=True)
    with open(os.path.join(out, "errors.json"), "w") as f:
        json.dump(results, f, indent=1)
