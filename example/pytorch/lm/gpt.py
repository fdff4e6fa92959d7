"""A small decoder-only transformer (GPT) in torch.nn: pre-LayerNorm blocks of causal
self-attention and a 4x MLP, learned position embeddings, and an output layer tied to the
token embedding. Byte-level: the vocabulary is 256."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers=4, width=128, heads=4, context=128):
        super().__init__()
        if width % heads:
            raise SystemExit(f"--width {width} is not a multiple of --heads {heads}")
        self.context = context
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaling of the residual projections
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        return self.ln(self.blocks(x)) @ self.tokens.weight.T  # tied output layer

    def loss(self, idx, targets):
        return byte_loss(self(idx), targets)


def byte_loss(logits, targets):
    """Mean cross-entropy in nats per byte (in float32 under autocast)."""
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())
