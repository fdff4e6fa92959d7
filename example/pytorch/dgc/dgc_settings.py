"""What DGC's settings mean for bps_gc: the ``compression_params`` of its DistributedOptimizer,
the bytes each kept element takes on the wire, and a note for every setting that works
differently here. No torch: --dry-run prints this without starting anything.

Indices: DGC's default sends int64 indices (int32.py: int32). bps_gc's sparse payloads (the
``dgc`` codec's sorted records, docs/codecs.md) always carry uint32 indices, which address any
partition of fewer than 2^32 elements exactly; so int64 and int32 train the same here, and both
send 4-byte indices (int64 is accepted with a note, not padded to 8 bytes).
"""
import os

from dgc_config import ConfigError

# the selection constants bps_gc's dgc codec implements (algorithms.md section 2.3)
FIXED = {"strided_sample": True, "resample": True, "compress_upper_bound": 1.3, "compress_lower_bound": 0.8,
         "max_adaptation_iters": 10}
DATASETS = ("cifar10", "imagenet")


def env_workers():
    """The number of workers the launcher started (1 outside a launcher: --dry-run)."""
    for name in ("WORLD_SIZE", "DMLC_NUM_WORKER"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def need(c, dotted, kind, low=None):
    node = c
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"configs.{dotted} is not set (give the data set's and model's config files, "
                              "e.g. configs/cifar/resnet20.py)")
        node = node[part]
    if not isinstance(node, kind) or isinstance(node, bool) or (low is not None and node < low):
        want = "a number" if kind != int else "a whole number"
        raise ConfigError(f"configs.{dotted} must be {want}{f' >= {low}' if low is not None else ''}, got {node!r}")
    return node


def checked(c):
    """Raises ConfigError naming the first setting a run cannot use."""
    if "dataset" not in c or c.dataset.get("name") not in DATASETS:
        raise ConfigError(f"configs.dataset.name must be one of {', '.join(DATASETS)} (give configs/cifar/... or "
                          "configs/imagenet/...)")
    need(c, "model.name", str)
    need(c, "model.num_classes", int, 1)
    need(c, "train.num_epochs", int, 1)
    need(c, "train.batch_size", int, 1)
    need(c, "train.optimizer.lr", (int, float), 0)
    need(c, "train.warmup_lr_epochs", int, 0)
    need(c, "dataset.image_size", int, 8)
    momentum = need(c, "train.optimizer.momentum", (int, float), 0)
    if not momentum < 1:
        raise ConfigError(f"configs.train.optimizer.momentum must be in [0, 1), got {momentum}")
    if c.train.num_batches_per_step != 1:
        raise ConfigError("configs.train.num_batches_per_step: only 1 here (start more workers instead)")
    if c.train.scheduler.get("name") not in ("cosine", "none", None):
        raise ConfigError(f"configs.train.scheduler.name: cosine or none, got {c.train.scheduler.get('name')!r}")
    limit = c.train.max_steps_per_epoch
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"configs.train.max_steps_per_epoch must be None or >= 1, got {limit!r}")


def warmup_densities(comp):
    """The kept fraction of each warm-up epoch, as DGC's code computes it."""
    epochs, coeff, r = comp.warmup_epochs, comp.warmup_coeff, comp.compress_ratio
    if not isinstance(epochs, int) or epochs <= 0:
        return []
    if coeff is None:  # DGC's default: r^((e+1)/(W+1)) (the paper: r^((e+1)/W))
        return [r ** ((e + 1) / (epochs + 1)) for e in range(epochs)]
    if isinstance(coeff, (int, float)):
        return [coeff ** (e + 1) for e in range(epochs)]
    coeff = list(coeff)
    if len(coeff) < epochs:
        raise ConfigError(f"configs.train.compression.warmup_coeff lists {len(coeff)} kept fractions for "
                          f"warmup_epochs = {epochs}")
    return coeff[:epochs]


def dgc_params(c, notes):
    comp, mem, opt = c.train.compression, c.train.compression.memory, c.train.optimizer
    for key, value in FIXED.items():
        if comp.get(key, value) != value:
            raise ConfigError(f"configs.train.compression.{key}: bps_gc's dgc codec implements {value!r} only")
    ratio = comp.compress_ratio
    if not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise ConfigError(f"configs.train.compression.compress_ratio is the kept fraction, in (0, 1); got {ratio!r}")
    params = {"compressor": "dgc", "k": float(ratio), "sample_ratio": float(comp.sample_ratio),
              "momentum_masking": bool(mem.momentum_masking)}
    densities = warmup_densities(comp)
    if densities:
        params["warmup_densities"] = [float(d) for d in densities]
    if comp.fp16_values:
        params["fp16_values"] = True
    if mem.gradient_clipping is not None:
        params["clip_norm"] = float(mem.gradient_clipping)
    if mem.momentum != opt.momentum:
        raise ConfigError(f"configs.train.compression.memory.momentum ({mem.momentum}) differs from "
                          f"configs.train.optimizer.momentum ({opt.momentum}): set both (the codec takes the "
                          "optimizer's)")
    if opt.momentum:  # DGC's momentum correction, in the form its memory names
        params["momentum"] = "nesterov" if mem.nesterov else "plain"
    if not comp.int32_indices:
        notes.append("int32_indices False (DGC's int64): bps_gc's sparse records carry uint32 indices "
                     "(exact below 2^32 elements per partition), 4 bytes each, not 8")
    if c.train.optimize_bn_separately and c.train.optimizer.weight_decay:
        notes.append("optimize_bn_separately: with DGC bps_gc moves one weight decay out of the optimizer for "
                     "every tensor, so BatchNorm parameters get weight decay too")
    from bps_gc.compress import CompressionParams, ParamError
    try:
        CompressionParams.from_dict(dict(params, **({"mu": opt.momentum} if "momentum" in params else {})))
    except ParamError as e:
        raise ConfigError(f"configs.train.compression: {e}") from None
    return params


def bps_gc_settings(c, workers):
    """{compression_params, wire, notes, workers} for the resolved settings ``c``."""
    notes = []
    if c.train.dgc:
        params = dgc_params(c, notes)
        notes.append("a resumed run restores the model, optimizer, epoch and best metric, and DGC's accumulated "
                     "gradients and momentum (bps_gc's codec state rides in optimizer.state_dict())")
        value_bytes = 2 if params.get("fp16_values") else 4
        wire = {"value_bytes": value_bytes, "index_bytes": 4,
                "dgc_index_bytes": 4 if c.train.compression.int32_indices else 8}
    else:
        if c.train.compression.get("name", "none") != "none":
            raise ConfigError(f"configs.train.compression.name {c.train.compression.name!r} without "
                              "configs.train.dgc: only none (dense) or the dgc files")
        params, wire = None, {"value_bytes": 4, "index_bytes": 0}
    return {"compression_params": params, "wire": wire, "notes": notes, "workers": workers}
