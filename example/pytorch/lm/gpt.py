"""A small decoder-only transformer (GPT) in torch.nn: pre-LayerNorm blocks of causal
self-attention and a 4x MLP, learned position embeddings, and an output layer tied to the
token embedding. Byte-level: the vocabulary is 256."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256


def attention_for(device_type, dtype):
    """The faster attention for a step on ``device_type`` with autocast ``dtype`` (None: float32):
    "plain" under bf16 on a CPU, else "sdpa". There SDPA's flash kernel (its backward above all)
    and its math backend are both slower than the plain products; float32 and CUDA keep SDPA
    (scripts/lm_step_time.py times every formulation at the default size)."""
    return "plain" if device_type == "cpu" and dtype == torch.bfloat16 else "sdpa"


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, computed as ``attention`` says: "sdpa" is
    F.scaled_dot_product_attention; "plain" is the same arithmetic as matrix products: the
    scaled scores plus a -inf mask above the diagonal (one fused add), softmax, times v."""

    def __init__(self, width, heads, attention="sdpa"):
        super().__init__()
        if attention not in ("sdpa", "plain"):
            raise ValueError(f"attention must be sdpa or plain, got {attention!r}")
        self.heads, self.attention = heads, attention
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = plain_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


def plain_attention(q, k, v):
    """softmax(q k^T / sqrt(d) with the future at -inf) v, in the products' dtype (bf16 under autocast)."""
    scores = q @ k.transpose(-2, -1)
    future = torch.full(scores.shape[-2:], float("-inf"), dtype=scores.dtype, device=scores.device).triu(1)
    return torch.softmax(torch.add(future, scores, alpha=q.shape[-1] ** -0.5), dim=-1) @ v


class Block(nn.Module):
    def __init__(self, width, heads, attention):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, attention)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``attention``: CausalSelfAttention's formulation (attention_for picks the faster one);
    the parameters do not depend on it."""

    def __init__(self, layers=4, width=128, heads=4, context=128, attention="sdpa"):
        super().__init__()
        if width % heads:
            raise SystemExit(f"--width {width} is not a multiple of --heads {heads}")
        self.context = context
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads, attention) for _ in range(layers)))
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
