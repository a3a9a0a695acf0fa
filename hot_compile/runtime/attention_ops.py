"""The backward of a half-precision attention as products of materialized scores.

The CPU's flash-attention backward streams its blocks through small loops: on Zen 4, at ViT-S's
heads, its five products run at about 60% of the float32 GEMM's rate in float32 and at a fifth of the
bf16 GEMM's in bf16. With the scores of a head materialized, the same gradients are five
products and one elementwise pass. For
``P = exp(scale·QKᵀ − lse)``, the probabilities the forward computed, and ``Δ = rowsum(dO ∘ O)``:

    dV = Pᵀ dO,   dS = scale · P ∘ (dO Vᵀ − Δ),   dQ = dS K,   dK = dSᵀ Q.

``QKᵀ`` and ``dO Vᵀ`` are float32 sums of the operands' exact products: ``P`` is an exponential of the
scores, and ``dS`` a difference of nearly equal terms, so neither may start from bf16 roundings.
``P`` and ``dS`` are rounded to the inputs' dtype where they enter the last three products, as the
bf16 flash kernel rounds them; each gradient is one rounding of a float32 sum.

Where the CPU has AVX512-BF16, one native kernel runs the whole backward, a block of a head's queries
at a time on a thread (:func:`bf16_attention_backward`): the score products on its pair products, a
tile at a time, fused with the elementwise pass (no float32 score stored, no operand upcast), then the
last three products from operands interleaved by pairs, while the block's ``P`` and ``dS`` stay in the
thread's caches, each gradient written in place into its flash-kernel layout. Elsewhere (float16, or without
AVX512-BF16) a chunk of heads at a time: float32 products of the upcast operands, stored, the
elementwise pass, then batched products. Against float64, the gradients of ViT-S's and MiniLM's heads
come out at 0.0024 relative error, between the float32 kernel's 0.0017 and the bf16 kernel's
0.0031–0.0033 (``tools/attention_bench.py``).

CPU only (its elementwise pass is :func:`attention_probabilities`).
No mask, no dropout, no causal mask: the graph pass keeps the fused kernel for those.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from . import cpu_kernels

# Heads per chunk where the scores are stored: the float32 scores of a chunk and their gradient stay
# within a few MiB, which the heap reuses from one chunk to the next.
CHUNK_BYTES = 2 << 20


def attention_probabilities(shifted: torch.Tensor, score_grad: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``P = exp(shifted)`` and ``P · score_grad`` in ``dtype``, each rounded once from float32:
    :func:`~hot_compile.runtime.attention_ops.attention_backward`'s one elementwise pass. ``shifted`` and
    ``score_grad``: float32 of one shape (made contiguous); ``exp`` within 2 ulp of float32's, and
    ``e⁻⁸⁷`` for arguments below −87."""
    shifted, score_grad = shifted.contiguous(), score_grad.contiguous()
    p, ds = torch.empty(shifted.shape, dtype=dtype), torch.empty(shifted.shape, dtype=dtype)
    cpu_kernels.library().hot_attention_probabilities(shifted.data_ptr(), score_grad.data_ptr(), shifted.numel(), cpu_kernels.dtype_code(p), p.data_ptr(), ds.data_ptr())
    return p, ds


def _head_strides(*tensors: Tensor) -> tuple[list[Tensor], Tensor]:
    """``tensors`` (``[B, H, ·, E]``) with their values made contiguous where they were not, and the batch,
    head and row strides of each in turn, as the C kernels take them."""
    operands = [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]
    return operands, torch.tensor([stride for t in operands for stride in t.stride()[:3]], dtype=torch.int64)


@functools.cache
def bf16_attention_backward() -> bool:
    """Whether :func:`attention_backward` runs as one native kernel here: the library has it (AVX-512)
    and the CPU has AVX512-BF16's pair products, which it calls."""
    return bool(cpu_kernels.library().hot_attention_backward_compiled()) and torch.cpu._is_avx512_bf16_supported()


def row_dots(grad_out: Tensor, out: Tensor) -> Tensor:
    """``Δ = rowsum(dO ∘ O)``, each row's products summed in float32: ``[B, H, L]`` float32 of two
    ``[B, H, L, E]`` tensors of one dtype, read in place."""
    b, h, l, e = out.shape
    (g, o), strides = _head_strides(grad_out, out)
    delta = torch.empty(b, h, l, dtype=torch.float32)
    cpu_kernels.library().hot_attention_row_dots(g.data_ptr(), o.data_ptr(), cpu_kernels.dtype_code(o), b, h, l, e, strides.data_ptr(), delta.data_ptr())
    return delta


def _gradient_layout(like: Tensor) -> Tensor:
    """An empty ``[B, H, L, E]`` gradient laid out as the flash kernels return theirs: ``[B, L, H, E]``
    in memory, so that the backward's transposes back to the projections' layout are views."""
    b, h, l, e = like.shape
    return like.new_empty(b, l, h, e).transpose(1, 2)


def _native(query: Tensor, value: Tensor) -> bool:
    """Whether the whole backward runs as one native kernel on AVX512-BF16's pair products
    (:func:`bf16_attention_backward`): bf16 operands, one even head size."""
    even = query.shape[-1] % 2 == 0 and value.shape[-1] == query.shape[-1]
    return query.dtype == torch.bfloat16 and even and bf16_attention_backward()


def _native_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor, scale: float
) -> tuple[Tensor, ...]:
    """:func:`attention_backward` by the native kernel, its gradients written in place in their layout."""
    b, h, l, e = query.shape
    grads = [_gradient_layout(t) for t in (query, key, value)]
    operands, strides = _head_strides(query, key, grad_out, value, *grads)
    lse = logsumexp.reshape(b * h, l).contiguous()
    delta = row_dots(grad_out, out)
    cpu_kernels.library().hot_attention_backward(
        *(t.data_ptr() for t in operands[:4]), b, h, l, key.shape[2], e, strides.data_ptr(),
        lse.data_ptr(), delta.data_ptr(), scale, *(t.data_ptr() for t in grads),
    )  # fmt: skip
    return tuple(grads)


def _scores(q: Tensor, k: Tensor, g: Tensor, v: Tensor, lse: Tensor, delta: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``P`` and ``dS`` of a chunk (``[B, H, ·, E]``, as ``[B·H, L, S]``) in the operands' dtype, from float32
    products of the upcast operands, then the elementwise pass."""
    dtype = q.dtype
    q, k, g, v = (t.flatten(0, 1).float() for t in (q, k, g, v))
    lse, delta = (t.flatten(0, 1).unsqueeze(-1) for t in (lse, delta))
    shifted = torch.baddbmm(lse, q, k.transpose(1, 2), beta=-1, alpha=scale)
    score_grad = torch.baddbmm(delta, g, v.transpose(1, 2), beta=-scale, alpha=scale)
    return attention_probabilities(shifted, score_grad, dtype)


@torch.library.custom_op("hot_compile::attention_backward", mutates_args=(), device_types="cpu")
def attention_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV)`` of ``out = softmax(scale·QKᵀ) V`` for ``query, out: [B, H, L, E]``, ``key, value:
    [B, H, S, E]`` and the forward's ``logsumexp: [B, H, L]`` (float32), in the inputs' dtype."""
    if _native(query, value):
        return _native_backward(grad_out, query, key, value, out, logsumexp, scale)
    b, h, l, e = query.shape
    s = key.shape[-2]
    # A chunk is a few whole batch entries, or a few heads of one entry where one entry's scores are larger.
    heads = max(1, CHUNK_BYTES // (4 * l * s))
    batch_step, head_step = (max(1, heads // h), h) if heads >= h else (1, heads)
    grads = [_gradient_layout(t) for t in (query, key, value)]
    deltas = row_dots(grad_out, out)
    for b0 in range(0, b, batch_step):
        for h0 in range(0, h, head_step):
            chunk = (slice(b0, b0 + batch_step), slice(h0, h0 + head_step))
            g, q, k, v = (t[chunk] for t in (grad_out, query, key, value))
            probabilities, score_grad = _scores(q, k, g, v, logsumexp[chunk], deltas[chunk], scale)
            g, q, k = (t.flatten(0, 1) for t in (g, q, k))
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
