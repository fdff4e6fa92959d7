"""What the LM script (train.py) and scripts/time_to_accuracy.py --task lm share: the
model's, data's and optimizer's flags, the learning-rate schedule, the optimizer, the clipped
step and the validation loss. torch is imported where it is used: the time-to-accuracy
driver reads only the flags here, and importing torch would cost it ~2 s of CPU."""
import math


def add_model_args(p):
    """The model's and data's shape (shared with scripts/time_to_accuracy.py --task lm)."""
    g = p.add_argument_group("model and data")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--width", type=int, default=144, help="embedding width")
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--context", type=int, default=128, help="tokens (bytes) per sequence")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    g.add_argument("--val-windows", type=int, default=64, help="sequences in the fixed validation set")
    g.add_argument("--corpus", default=None, help="a folder of *.py files instead of the standard library's")
    return g


def add_optimizer_args(p):
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument("--lr", type=float, default=None, help="peak rate (default: adamw 3e-3, sgd 0.3)")
    g.add_argument("--momentum", type=float, default=0.9, help="sgd's momentum (nesterov)")
    g.add_argument("--wd", type=float, default=0.01, help="weight decay")
    g.add_argument("--warmup", type=int, default=30, help="steps of the linear warm-up")
    g.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: none)")
    return g


def check_args(args, parser):
    for name in ("steps", "batch_size", "layers", "width", "heads", "context", "val_windows", "eval_every"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr is None:
        args.lr = 3e-3 if args.optimizer == "adamw" else 0.3


def build_model(args, device, attention="sdpa"):
    """The seeded GPT on ``device``; ``attention``: gpt.attention_for's choice for the step's precision."""
    import torch
    from gpt import GPT
    torch.manual_seed(args.seed)
    return GPT(args.layers, args.width, args.heads, args.context, attention).to(device)


def lr_at(args, step):
    """Linear warm-up to --lr, then a cosine to --lr / 10 at --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(args, model):
    import torch
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, nesterov=args.momentum > 0,
                               weight_decay=args.wd)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(0.9, 0.95))


def evaluate(model, val, device, amp):
    """Mean validation loss (nats per byte) over the fixed windows, 16 at a time."""
    import torch
    model.eval()
    total = 0.0
    with torch.no_grad(), amp.autocast():
        for start in range(0, len(val[0]), 16):
            x, y = (torch.from_numpy(a[start:start + 16]).to(device) for a in val)
            total += float(model.loss(x, y)) * len(x)
    model.train()
    return total / len(val[0])


def clipped_step(opt, model, clip, synchronizes):
    """Clip the averaged gradients, then step (DistributedOptimizer averages in synchronize())."""
    if synchronizes:
        opt.synchronize()
    if clip > 0:
        import torch
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if synchronizes:
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()


