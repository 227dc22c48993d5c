"""BERT-small and GPT-small as embedding, attention and feed-forward sub-block layers, and a head."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from engine.models.spec import ModelSpec


class Attention(nn.Module):
    """Multi-head self-attention written with matmuls, so the FLOP counter sees its cost."""

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, Dh)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)  # (B, H, T, T)
        if self.causal:
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        out = scores.softmax(-1) @ v  # (B, H, T, Dh)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


def mlp(dim: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class Embedding(nn.Module):
    """Token plus learned position embeddings (then LayerNorm for BERT)."""

    def __init__(self, vocab: int, seq_len: int, dim: int, norm: bool) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(seq_len, dim)
        self.norm = nn.LayerNorm(dim) if norm else nn.Identity()
        nn.init.normal_(self.token.weight, std=0.02)
        nn.init.normal_(self.position.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.norm(self.token(tokens) + self.position(positions))  # (B, T, D)


class PostNorm(nn.Module):
    """BERT sub-block: LayerNorm(x + f(x))."""

    def __init__(self, dim: int, f: nn.Module) -> None:
        super().__init__()
        self.f = f
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.f(x))


class PreNorm(nn.Module):
    """GPT sub-block: x + f(LayerNorm(x))."""

    def __init__(self, dim: int, f: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.f = f

    def forward(self, x: Tensor) -> Tensor:
        return x + self.f(self.norm(x))


class Pooler(nn.Module):
    """BERT classification head: first token, tanh pooler, linear classifier."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.tanh(self.dense(x[:, 0])))  # (B, classes)


def bert_layers(
    vocab: int = 8192,
    seq_len: int = 128,
    dim: int = 512,
    heads: int = 8,
    ffn: int = 2048,
    depth: int = 4,
    num_classes: int = 2,
) -> list[nn.Module]:
    layers: list[nn.Module] = [Embedding(vocab, seq_len, dim, norm=True)]
    for _ in range(depth):
        layers += [PostNorm(dim, Attention(dim, heads, causal=False)), PostNorm(dim, mlp(dim, ffn))]
    layers.append(Pooler(dim, num_classes))
    return layers


def gpt_layers(
    vocab: int = 8192, seq_len: int = 128, dim: int = 384, heads: int = 6, ffn: int = 1536, depth: int = 6
) -> list[nn.Module]:
    layers: list[nn.Module] = [Embedding(vocab, seq_len, dim, norm=False)]
    for _ in range(depth):
        layers += [PreNorm(dim, Attention(dim, heads, causal=True)), PreNorm(dim, mlp(dim, ffn))]
    # Untied LM head: tying would share a weight across stages.
    layers += [nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)]
    return layers


def specs() -> list[ModelSpec]:
    return [
        ModelSpec(
            "bert-small",
            "transformer",
            "classification",
            (128,),
            "int64",
            2,
            "BERT-small encoder (4 layers, hidden 512, 8 heads, FFN 2048, seq 128) for 2-class sequence classification",
            bert_layers,
            vocab_size=8192,
        ),
        ModelSpec(
            "gpt-small",
            "transformer",
            "language-modeling",
            (128,),
            "int64",
            8192,
            "GPT-style pre-LN causal decoder (6 layers, d_model 384, 6 heads, FFN 1536, seq 128)",
            gpt_layers,
            vocab_size=8192,
        ),
    ]
