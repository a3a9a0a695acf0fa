"""The tests' models: the harness's own at small sizes (user-defined modules, not bare nn.Sequential:
Dynamo skips torch.nn frames in some paths)."""

import torch
import torch.nn as nn

from hot_compile.harness import models


def MLP(dim=32, hidden=64, out=16, bias=True) -> nn.Module:
    """The benchmarks' MLP at the tests' sizes."""
    return models.MLP(dim, hidden, out, bias)


def Block(dim=32, heads=4) -> nn.Module:
    """The benchmarks' transformer block at the tests' sizes, with the attention written out: its
    batched matmuls of activations sit beside the linears' in the joint graph, and are no sites."""
    return models.Block(dim, heads, sdpa=False)


def gradient_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Per-parameter relative error of ``model``'s gradients against those of its float64 copy
    ``reference``, after both ran their backward.

    Parameters whose exact gradient vanishes (a key bias: softmax ignores a per-row constant) have no
    relative error and are left out.
    """
    ref = dict(reference.named_parameters())
    scale = max(p.grad.norm() for p in ref.values() if p.grad is not None)
    return {
        name: ((p.grad.double() - ref[name].grad).norm() / ref[name].grad.norm()).item()
        for name, p in model.named_parameters()
        if p.grad is not None and ref[name].grad.norm() > 1e-9 * scale
    }


def grad_errors(model: nn.Module, compiled, x: torch.Tensor) -> dict[str, float]:
    """:func:`gradient_errors` of ``compiled`` (``model`` compiled) on the loss ``mean(out²)`` at ``x``,
    against an fp64 eager copy of ``model``."""
    import copy

    reference = copy.deepcopy(model).double()
    model.zero_grad()
    compiled(x).square().mean().backward()
    reference(x.double()).square().mean().backward()
    return gradient_errors(model, reference)
