"""The tiny network and per-rank batches that the torch optimizer jobs train (torch_job.py,
torch_granularity_job.py): the same initial weights on every rank, other data per rank."""
import torch


def network():
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 8, generator=g)
