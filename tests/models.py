"""Small user-defined models (not bare nn.Sequential: Dynamo skips torch.nn frames in some paths)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim=32, hidden=64, out=16, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, out, bias=bias)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = (q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, attention, LayerNorm, GELU MLP (all 3-D, with bias)."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def grad_errors(model: nn.Module, compiled, x: torch.Tensor) -> dict[str, float]:
    """Per-parameter relative error of ``compiled``'s gradients vs an fp64 eager copy of ``model``.

    Parameters whose exact gradient vanishes (a key bias: softmax ignores a per-row constant) have no
    relative error and are left out.
    """
    import copy

    reference = copy.deepcopy(model).double()
    model.zero_grad()
    compiled(x).square().mean().backward()
    reference(x.double()).square().mean().backward()
    ref = dict(reference.named_parameters())
    scale = max(p.grad.norm() for p in ref.values() if p.grad is not None)
    return {
        name: ((p.grad.double() - ref[name].grad).norm() / ref[name].grad.norm()).item()
        for name, p in model.named_parameters()
        if p.grad is not None and ref[name].grad.norm() > 1e-9 * scale
    }
