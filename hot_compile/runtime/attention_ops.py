"""The backward of a half-precision attention as batched products, a chunk of heads at a time.

The CPU's flash-attention backward streams its blocks through small loops: on Zen 4, at ViT-S's
heads, its five products run at about 60% of the float32 GEMM's rate in float32 and at a fifth of the
bf16 GEMM's in bf16. With the scores of a few heads materialized, the same gradients are five
batched products and one elementwise pass. For
``P = exp(scale·QKᵀ − lse)``, the probabilities the forward computed, and ``Δ = rowsum(dO ∘ O)``:

    dV = Pᵀ dO,   dS = scale · P ∘ (dO Vᵀ − Δ),   dQ = dS K,   dK = dSᵀ Q.

``QKᵀ`` and ``dO Vᵀ`` are float32 products of the upcast operands: ``P`` is an exponential of the
scores, and ``dS`` a difference of nearly equal terms, so neither may start from bf16 roundings.
``P`` and ``dS`` are rounded to the inputs' dtype where they enter the last three products, as the
bf16 flash kernel rounds them; each gradient is one rounding of a float32 sum. Against float64, the
gradients of ViT-S's and MiniLM's heads come out at 0.0024 relative error, between the float32
kernel's 0.0017 and the bf16 kernel's 0.0031–0.0033 (``tools/attention_bench.py``).

CPU only (its elementwise pass is :func:`~hot_compile.runtime.cpu_kernels.attention_probabilities`).
No mask, no dropout, no causal mask: the graph pass keeps the fused kernel for those.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import cpu_kernels

# Heads per chunk: the float32 scores of a chunk and their gradient stay within a few MiB, which
# the heap reuses from one chunk to the next.
CHUNK_BYTES = 2 << 20


def _gradient_layout(like: Tensor) -> Tensor:
    """An empty ``[B, H, L, E]`` gradient laid out as the flash kernels return theirs: ``[B, L, H, E]``
    in memory, so that the backward's transposes back to the projections' layout are views."""
    b, h, l, e = like.shape
    return like.new_empty(b, l, h, e).transpose(1, 2)


@torch.library.custom_op("hot_compile::attention_backward", mutates_args=(), device_types="cpu")
def attention_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV)`` of ``out = softmax(scale·QKᵀ) V`` for ``query, out: [B, H, L, E]``, ``key, value:
    [B, H, S, E]`` and the forward's ``logsumexp: [B, H, L]`` (float32), in the inputs' dtype."""
    b, h, l, e = query.shape
    s = key.shape[-2]
    # A chunk is a few whole batch entries, or a few heads of one entry where one entry's scores are larger.
    heads = max(1, CHUNK_BYTES // (4 * l * s))
    batch_step, head_step = (max(1, heads // h), h) if heads >= h else (1, heads)
    grads = [_gradient_layout(t) for t in (query, key, value)]
    for b0 in range(0, b, batch_step):
        for h0 in range(0, h, head_step):
            chunk = (slice(b0, b0 + batch_step), slice(h0, h0 + head_step))
            g, q, k, v, o = (t[chunk].flatten(0, 1) for t in (grad_out, query, key, value, out))
            g32 = g.float()
            delta = (g32 * o.float()).sum(-1, keepdim=True)
            lse = logsumexp[chunk].flatten(0, 1).unsqueeze(-1)
            shifted = torch.baddbmm(lse, q.float(), k.float().transpose(1, 2), beta=-1, alpha=scale)
            score_grad = torch.baddbmm(delta, g32, v.float().transpose(1, 2), beta=-scale, alpha=scale)
            probabilities, score_grad = cpu_kernels.attention_probabilities(shifted, score_grad, query.dtype)
            chunk_grads = (
                torch.bmm(score_grad, k),
                torch.bmm(score_grad.transpose(1, 2), q),
                torch.bmm(probabilities.transpose(1, 2), g),
            )
            for grad, chunk_grad in zip(grads, chunk_grads):
                grad[chunk].copy_(chunk_grad.view(grad[chunk].shape))
    return tuple(grads)


@attention_backward.register_fake
def _(grad_out, query, key, value, out, logsumexp, scale):
    return tuple(_gradient_layout(t) for t in (query, key, value))
