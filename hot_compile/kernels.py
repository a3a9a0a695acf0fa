"""HOT's three operations as opaque custom ops, each run by one shape-generic compiled kernel set.

The graph pass inserts ``torch.ops.hot_compile.hq_grad_input``, ``compress_activation`` and
``hla_grad_weight`` nodes rather than the aten code of :mod:`hot_compile.ops`. Inlined, every rewritten
site brought its own transform, hash and quantizer kernels for Inductor to schedule, generate and
compile in C++, per layer shape: a ViT stack compiled five times slower than under plain Inductor.
Here a site adds one extern call to the model's graph. The implementation, :mod:`hot_compile.ops`
compiled by Inductor with dynamic shapes, is built once per process and configuration (later
processes find it in Inductor's FX graph cache) and serves every site, layer shape and model.

Each op accepts inputs of any strides and returns contiguous outputs, as its fake implementation
declares.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch
from torch import Tensor
from torch._dynamo.utils import counters

from . import ops
from .hadamard import BLOCK, lowpass_rows, tail_basis

# Joint-graph passes installed in Inductor's global config (HOT's own among them) are for models'
# graphs, not for these kernels.
_KERNEL_INDUCTOR_OPTIONS = {"joint_custom_pre_pass": None, "joint_custom_post_pass": None}

_build_seconds = 0.0
_SPECIALIZE_SETTINGS = torch._dynamo.config.patch(specialize_int=True)


@functools.cache
def _kernel(fn: Callable, config: tuple[tuple[str, object], ...]) -> Callable:
    """``fn`` with keyword settings ``config``, compiled for any shapes (and, by :func:`_run`, specialized
    on the settings)."""
    settings = dict(config)

    def kernel(*tensors: Tensor):
        return fn(*tensors, **settings)

    # A code object of its own: Dynamo keeps compiled entries, and counts recompiles against its limit,
    # per code object, so each configuration gets the limit for its own dtypes and stride patterns.
    kernel.__code__ = kernel.__code__.replace(co_name=f"{fn.__name__}_kernel")
    return torch.compile(kernel, dynamic=True, fullgraph=True, options=_KERNEL_INDUCTOR_OPTIONS)


def _run(fn: Callable, *tensors: Tensor, **settings):
    global _build_seconds
    graphs_before = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    # What Dynamo guards must not vary between calls that one kernel serves, or it builds another:
    # - each tensor's dispatch keys, as the thread-local state shows them. A compiled graph's first call
    #   reaches the op through AOTAutograd's aliasing-check mode, with ADInplaceOrView excluded, and
    #   later calls without it: one state for both.
    # - a view's base, and a Parameter's static shapes: detached tensors are neither.
    # The settings are constants of the kernel: under dynamic=True Dynamo would otherwise make the
    # integer ones (rank, bits) symbols, and every shape expression of the trace products of symbols
    # (an HLA kernel compiled 1.5× slower).
    with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView(), _SPECIALIZE_SETTINGS:
        out = _kernel(fn, tuple(sorted(settings.items())))(*(t.detach() for t in tensors))
    if counters["stats"]["unique_graphs"] != graphs_before:
        _build_seconds += time.perf_counter() - start
    return out


def build_seconds() -> float:
    """Seconds this process has spent in calls of HOT's ops that built a kernel (the first call of
    each configuration, whole): the part of a first training step that is not the model's compile."""
    return _build_seconds


@torch.library.custom_op("hot_compile::hq_grad_input", mutates_args=())
def hq_grad_input(
    grad_output: Tensor,
    weight: Tensor,
    seed: Tensor,
    grad_bits: int,
    weight_bits: int,
    per_token: bool,
    hadamard: bool,
    weight_quantizer: str,
) -> Tensor:
    """:func:`hot_compile.ops.hq_grad_input` as one op: ``[..., N] × [N, K] → [..., K]``."""
    return _run(
        ops.hq_grad_input,
        grad_output,
        weight,
        seed,
        grad_bits=grad_bits,
        weight_bits=weight_bits,
        per_token=per_token,
        hadamard=hadamard,
        weight_quantizer=weight_quantizer,
    ).contiguous()


@hq_grad_input.register_fake
def _(grad_output, weight, seed, grad_bits, weight_bits, per_token, hadamard, weight_quantizer):
    return grad_output.new_empty(*grad_output.shape[:-1], weight.shape[1])


@functools.cache
def _cached_tail_basis(remainder: int, rank: int, device: torch.device) -> Tensor:
    return tail_basis(remainder, rank, device=device)


def _tail_basis(t: Tensor, rank: int) -> Tensor:
    """``tail_basis`` of ``t``'s token count mod 16: an input of the kernels, not a constant in them,
    so that one kernel serves every ``L mod 16``."""
    return _cached_tail_basis(t.numel() // t.shape[-1] % BLOCK, rank, t.device)


@torch.library.custom_op("hot_compile::compress_activation", mutates_args=())
def compress_activation(x: Tensor, rank: int, bits: int, per_channel: bool) -> tuple[Tensor, Tensor]:
    """:func:`hot_compile.ops.compress_activation` as one op: ``[..., K] → ([⌊r·L/16⌋ at most, K] int8,
    scale [1, K] or 0-d)``."""
    tail = _tail_basis(x, rank)
    x_q, scale = _run(ops.compress_activation, x, tail, rank=rank, bits=bits, per_channel=per_channel)
    return x_q.contiguous(), scale.contiguous()


@compress_activation.register_fake
def _(x, rank, bits, per_channel):
    rows = lowpass_rows(x.numel() // x.shape[-1], rank)
    scale_shape = (1, x.shape[-1]) if per_channel else ()
    return x.new_empty(rows, x.shape[-1], dtype=torch.int8), x.new_empty(scale_shape, dtype=torch.float32)


@torch.library.custom_op("hot_compile::hla_grad_weight", mutates_args=())
def hla_grad_weight(
    grad_output: Tensor,
    x_q: Tensor,
    x_scale: Tensor,
    seed: Tensor,
    rank: int,
    bits: int,
    per_channel: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """:func:`hot_compile.ops.hla_grad_weight` as one op: ``[..., N]`` and the ABC buffer → ``[N, K]``."""
    tail = _tail_basis(grad_output, rank)
    return _run(
        ops.hla_grad_weight,
        grad_output,
        x_q,
        x_scale,
        seed,
        tail,
        rank=rank,
        bits=bits,
        per_channel=per_channel,
        out_dtype=out_dtype,
    ).contiguous()


@hla_grad_weight.register_fake
def _(grad_output, x_q, x_scale, seed, rank, bits, per_channel, out_dtype):
    return grad_output.new_empty(grad_output.shape[-1], x_q.shape[1], dtype=out_dtype)
