"""Where a PyTorch example trains, shared by every script: ``--device auto|cpu|cuda|cuda:N``
(``auto``: ``cuda:LOCAL_RANK % device_count`` where CUDA is available, else the CPU), batches
copied onto it from pinned memory without blocking, mixed precision (autocast and a gradient
scaler) where a seed trains in it, and ``--precision auto``'s choice: bf16 where the device
computes it natively (``pick_precision``).

Asking for CUDA where there is none is one note line and the CPU; a rank told to use a GPU this
host does not have stops with one line naming it. ``choose_device`` decides from plain
arguments (tests give it fake device counts); ``pick_device`` asks torch and logs the choice.
"""
import argparse
import contextlib
import os

DEVICE_HELP = ("where to train: auto (cuda:LOCAL_RANK %% GPUs when CUDA is available, else the CPU), "
               "cpu, cuda, or cuda:N")


class DeviceError(SystemExit):
    """A device this host does not have: one line, no traceback."""


def parse_device(text):
    """argparse type of --device: auto, cpu, cuda (or gpu) or cuda:N."""
    word = str(text).strip().lower()
    if word == "gpu":
        return "cuda"
    if word in ("auto", "cpu", "cuda") or (word.startswith("cuda:") and word[5:].isdigit()):
        return word
    raise argparse.ArgumentTypeError(f"want auto, cpu, cuda or cuda:N, got {text!r}")


def add_device_arg(parser, default="auto"):
    parser.add_argument("--device", type=parse_device, default=default, help=DEVICE_HELP)


def from_num_gpus(num_gpus, device):
    """BytePS's --num-gpus (GPUs per worker; 0: the CPU) as a --device word; unset: ``device``.
    (word, note or None): one GPU per worker process here."""
    if num_gpus is None:
        return device, None
    if num_gpus < 0:
        raise DeviceError(f"--num-gpus must be >= 0, got {num_gpus}")
    if num_gpus == 0:
        return "cpu", None
    note = (f"--num-gpus {num_gpus}: one GPU per worker process here (start {num_gpus} workers per host "
            "instead)") if num_gpus > 1 else None
    return ("cuda" if device == "auto" else device), note


def local_rank_from_env(environ=None):
    """This process's rank on its host: torchrun's LOCAL_RANK, bpslaunch's BYTEPS_LOCAL_RANK, else 0."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_RANK", "BYTEPS_LOCAL_RANK"):
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def choose_device(requested, local_rank, cuda_available, device_count):
    """(device name, note or None) for ``requested`` (parse_device's words) on a host with
    ``device_count`` CUDA devices. Raises DeviceError for cuda:N beyond them."""
    if requested == "cpu":
        return "cpu", None
    if not cuda_available or device_count < 1:
        if requested == "auto":
            return "cpu", None
        return "cpu", f"{requested} asked for, but this host has no CUDA device: training on the CPU"
    if requested in ("auto", "cuda"):
        return f"cuda:{local_rank % device_count}", None
    index = int(requested.split(":")[1])
    if index >= device_count:
        raise DeviceError(f"device {requested}: this host has {device_count} CUDA device(s), "
                          f"cuda:0 to cuda:{device_count - 1}")
    return requested, None


def pick_device(requested, local_rank=None):
    """(torch.device, [log lines]): the choice for this process, its CUDA device made current.
    The lines are the note (if any) and one line naming the device."""
    import torch
    rank = local_rank_from_env() if local_rank is None else local_rank
    available = torch.cuda.is_available()
    name, note = choose_device(requested, rank, available, torch.cuda.device_count() if available else 0)
    device = torch.device(name)
    lines = [f"note: {note}"] if note else []
    if device.type == "cuda":
        torch.cuda.set_device(device)
        lines.append(f"device: {name} ({torch.cuda.get_device_name(device)}; local rank {rank}, "
                     f"{torch.cuda.device_count()} CUDA devices)")
    else:
        lines.append(f"device: cpu (asked: {requested})")
    return device, lines


def pinned(batch, device):
    """The batch's tensors in page-locked memory when they go to a CUDA device (in the loader
    threads, so the copy in ``moved`` does not block), else as they are."""
    if device.type != "cuda":
        return batch
    return tuple(t.pin_memory() for t in batch)


def moved(batch, device):
    """The batch's tensors on ``device`` (non_blocking from pinned memory on CUDA)."""
    if device.type != "cuda":
        return batch
    return tuple(t.to(device, non_blocking=True) for t in batch)


def on_device(batches, device):
    """Each batch of ``batches`` pinned and moved onto ``device``."""
    for batch in batches:
        yield moved(pinned(batch, device), device)


# CPU features that compute bfloat16 natively: x86's AMX and AVX-512 BF16 (torch's and Linux's
# names), Arm's BF16 and SVE BF16. Without them autocast bf16 is emulated and slower than float32.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16", "sve_bf16", "svebf16")
PRECISION_HELP = ("auto: bf16 autocast where the device computes bf16 natively (a CUDA device of compute "
                  "capability 8.0 or later; a CPU with " + ", ".join(BF16_CPU_FLAGS[:3]) + " or SVE bf16), "
                  "else float32; the startup line says which and why")


def cpu_flags():
    """This CPU's feature names: torch's own reading (torch.cpu.get_capabilities, newer torch),
    else Linux's /proc/cpuinfo (x86 "flags", Arm "Features"); empty where neither says."""
    import torch
    capabilities = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
    if capabilities is not None:
        try:
            return {name for name, value in capabilities().items() if value is True}
        except (RuntimeError, AttributeError):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            return {word for line in f if line.startswith(("flags", "Features"))
                    for word in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def choose_precision(requested, device_type, cuda_bf16=False, flags=()):
    """("bf16" or "fp32", why) for ``requested`` (auto, bf16 or fp32) on ``device_type``:
    ``cuda_bf16`` whether the CUDA device computes bf16 natively, ``flags`` the CPU's feature names."""
    if requested != "auto":
        return requested, "asked for"
    if device_type == "cuda":
        return ("bf16", "auto: this CUDA device computes bf16 natively") if cuda_bf16 else \
            ("fp32", "auto: this CUDA device computes bf16 only by emulation (before compute capability 8.0)")
    native = [flag for flag in BF16_CPU_FLAGS if flag in flags]
    if native:
        return "bf16", f"auto: this CPU computes bf16 natively ({', '.join(native)})"
    return "fp32", f"auto: this CPU has none of {', '.join(BF16_CPU_FLAGS)} (bf16 would be emulated, slower)"


def pick_precision(requested, device):
    """(torch.bfloat16 or None for float32, log line): choose_precision on this machine."""
    import torch
    # natively: compute capability 8.0+ (Ampere on) or ROCm; torch.cuda.is_bf16_supported() also
    # counts older GPUs' emulation
    cuda_bf16 = device.type == "cuda" and (bool(torch.version.hip)
                                           or torch.cuda.get_device_properties(device).major >= 8)
    name, why = choose_precision(requested, device.type, cuda_bf16, cpu_flags() if device.type == "cpu" else ())
    words = "bf16 autocast" if name == "bf16" else "float32"
    return (torch.bfloat16 if name == "bf16" else None), f"precision: {words}; {why}"


class MixedPrecision:
    """Mixed precision for a training step: the forward pass under torch.autocast in ``dtype``
    and, for float16, a gradient scaler. Parameters, gradients and the codecs' state
    (error feedback, momentum) stay float32: autocast only casts inside the forward pass.

        with amp.autocast(): loss = F.cross_entropy(model(x), y)
        amp.backward_and_step(loss, optimizer)

    Disabled (``dtype`` None) it is a plain backward() and step()."""

    def __init__(self, device, dtype=None, init_scale=2.0 ** 16):
        import torch
        self.device, self.dtype = device, dtype
        self.enabled = dtype is not None
        self.scaler = torch.amp.GradScaler(device.type, init_scale=float(init_scale),
                                           enabled=self.enabled and dtype == torch.float16)
        self.growth = 0  # finite steps since the scale last changed (bps_gc optimizers: next_scale)

    def describe(self):
        if not self.enabled:
            return "float32"
        return f"mixed precision: autocast {str(self.dtype).replace('torch.', '')} on {self.device.type}" + \
            (", gradient scaler" if self.scaler.is_enabled() else "")

    def autocast(self):
        import torch
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward_and_step(self, loss, optimizer):
        """Backward of the scaled loss, then the step, skipped when a reduced gradient holds
        inf/NaN (the codecs let non-finite values through: docs/codecs.md), and the scale
        updated as torch.amp's. bps_gc's DistributedOptimizer unscales each gradient before
        its codec (set_gradient_factor): codec state and weight decay stay in true units."""
        if not self.scaler.is_enabled():
            loss.backward()
            optimizer.step()
            return
        if not hasattr(optimizer, "set_gradient_factor"):  # a plain optimizer (DDP reduced in backward)
            self.scaler.scale(loss).backward()
            self.scaler.step(optimizer)
            self.scaler.update()
            return
        import torch
        scale = self.scaler.get_scale()
        optimizer.set_gradient_factor(1.0 / scale)
        self.scaler.scale(loss).backward()
        optimizer.synchronize()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
        if finite:
            with optimizer.skip_synchronize():
                optimizer.step()
        self.scaler.update(float(self.next_scale(scale, finite)))  # update() takes a float or a tensor

    def next_scale(self, scale, finite):
        """torch.amp's rule: back off after a non-finite step, grow after growth_interval finite ones."""
        if not finite:
            self.growth = 0
            return scale * self.scaler.get_backoff_factor()
        self.growth += 1
        if self.growth < self.scaler.get_growth_interval():
            return scale
        self.growth = 0
        return scale * self.scaler.get_growth_factor()
