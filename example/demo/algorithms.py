"""The demo's rows for algorithms that communicate less often or without a server (issue 13):
(post-)local SGD (bps_gc.torch.LocalSGD) and CHOCO-SGD / D-PSGD on a ring
(bps_gc.torch.DecentralizedOptimizer). mnist_demo.py runs them with --algorithms; mnist_worker.py
builds the optimizer with ``distributed_optimizer``.

Bytes per step of a row: what a worker pushes and pulls through the servers, plus what it sends
to its graph neighbours (each neighbour receives as much, counted once at the sender).
"""
# name -> (description, workers, algorithm); the learning rates are the baseline's
ALGORITHMS = {
    "localsgd-h4": ("local SGD, H=4", 2, {"optimizer": "local_sgd", "local_steps": 4}),
    "postlocal-h4": ("post-local SGD, H=4 from half-way", 2,
                     {"optimizer": "local_sgd", "local_steps": 4, "local_from_fraction": 0.5}),
    "choco-signnorm": ("CHOCO signnorm, ring of 4", 4,
                       {"optimizer": "choco", "graph": "ring", "gamma": 0.45,
                        "compression": {"compressor": "signnorm"}}),
    "choco-top1": ("CHOCO top-1%, ring of 4", 4,
                   {"optimizer": "choco", "graph": "ring", "gamma": 0.05,
                    "compression": {"compressor": "topk", "k": 0.01}}),
    "dpsgd": ("D-PSGD, ring of 4", 4, {"optimizer": "dpsgd", "graph": "ring"}),
}


def signnorm_params(params):
    """{'compressor': 'signnorm'} where this bps_gc lacks the name: onebit with scaling, the
    same format."""
    from bps_gc.compress import CompressionParams, ParamError
    try:
        CompressionParams.from_dict(params)
        return params
    except ParamError:
        return {"compressor": "onebit", "scaling": True}


def distributed_optimizer(opt, model, algorithm, total_steps):
    """``opt`` wrapped for ``algorithm`` (a value of ALGORITHMS)."""
    import bps_gc.torch as bps  # here: the demo's driver reads ALGORITHMS without importing torch
    named = list(model.named_parameters())
    kind = algorithm["optimizer"]
    if kind == "local_sgd":
        # the demo has no epochs to speak of: the switch is a fraction of the steps, as an "epoch"
        # counted in steps (set_epoch(step) in the worker)
        switch = int(algorithm.get("local_from_fraction", 0) * total_steps)
        return bps.LocalSGD(opt, named, local_steps=algorithm["local_steps"], local_from_epoch=switch)
    compression = algorithm.get("compression")
    if compression and compression.get("compressor") == "signnorm":
        compression = signnorm_params(compression)
    return bps.DecentralizedOptimizer(opt, named, algorithm="choco" if kind == "choco" else "dpsgd",
                                      topology=algorithm["graph"], consensus_stepsize=algorithm.get("gamma", 1.0),
                                      compression_params=compression)


def gossip_bytes(opt):
    """Bytes this worker sent to its neighbours (0 for the server-based optimizers)."""
    return opt.bytes_sent() if hasattr(opt, "bytes_sent") else 0


def gossip_raw_bytes(opt):
    """What the gossip would have sent uncompressed: the float model to every neighbour, each round."""
    if not hasattr(opt, "bytes_sent"):
        return 0
    model = sum(p.numel() * p.element_size() for p in opt.params.values())
    return model * len(opt.gossip.neighbours) * opt.gossip.rounds
