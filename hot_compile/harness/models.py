"""The models of the benchmarks, the demo, the training tasks and the tests: one transformer block
(pre-norm, multi-head attention with a fused qkv projection, GELU MLP) and what wraps it."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """The transformer MLP: Linear → GELU → Linear (``out`` features, ``dim`` unless given)."""

    def __init__(self, dim: int, hidden: int, out: int | None = None, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, out or dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (as in timm's ViT and GPT-2).

    ``sdpa=False`` writes it out (``softmax(q kᵀ/√d) v``, two batched matmuls of activations), the
    form of models that predate ``scaled_dot_product_attention``.
    """

    def __init__(self, dim: int, heads: int, causal: bool = False, sdpa: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads, self.causal, self.sdpa = heads, causal, sdpa
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
            if self.causal:
                scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), -math.inf)
            y = scores.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + mlp(LN(x)), the MLP 4× wide."""

    def __init__(self, dim: int, heads: int, causal: bool = False, sdpa: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal, sdpa)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ViTStack(nn.Module):
    """ViT blocks over patch tokens (the patch embedding and head are left out)."""

    def __init__(self, dim: int, heads: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class BasicBlock(nn.Module):
    """ResNet's basic block at one width: 3×3 conv, BatchNorm, ReLU, 3×3 conv, BatchNorm, plus the input."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNetStack(nn.Module):
    """Basic blocks at one width and resolution (ResNet-18/34's first stage without its stem)."""

    def __init__(self, channels: int, depth: int):
        super().__init__()
        self.blocks = nn.Sequential(*(BasicBlock(channels) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class LastHiddenState(nn.Module):
    """A Hugging Face encoder as ``token ids → last hidden state``."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=ids).last_hidden_state


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) weights, zero biases, unit LayerNorm."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
