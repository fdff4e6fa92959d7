"""Models the benchmarks train that are not a real network: scripts/bench_hook.py's
``--model resnet50-shapes``."""


def shapes_model(shapes, rank):
    """Parameters of ``shapes``; loss = sum of each parameter times a fixed random tensor (the
    rank's own), so each gradient is that tensor: ResNet-50's gradients for a multiply-add each."""
    import torch

    class Shapes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(1000 + rank)
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s)) for s in shapes)
            self.factors = [torch.randn(s, generator=g) for s in shapes]

        def forward(self):
            return sum((w * f).sum() for w, f in zip(self.weights, self.factors))
    return Shapes()
