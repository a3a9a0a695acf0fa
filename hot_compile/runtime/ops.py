"""HOT's three operations as opaque custom ops, each run by one shape-generic compiled kernel set.

The graph pass inserts ``torch.ops.hot_compile.hq_grad_input``, ``compress_activation`` and
``hla_grad_weight`` nodes rather than the aten code of :mod:`hot_compile.runtime.aten_impl`. Inlined, every rewritten
site brought its own transform, hash and quantizer kernels for Inductor to schedule, generate and
compile in C++, per layer shape: a ViT stack compiled five times slower than under plain Inductor.
Here a site adds one extern call to the model's graph. The implementation, :mod:`hot_compile.runtime.aten_impl`
compiled by Inductor with dynamic shapes, is built once per process and configuration (later
processes find it in Inductor's FX graph cache) and serves every site, layer shape and model.

On the CPU each op has its own kernel (``register_kernel("cpu")``) on the fused native loops of
:mod:`hot_compile.runtime.cpu_kernels` and the integer GEMM of :func:`hot_compile.runtime.int8_gemm.int8_matmul`, with the
same numerics: there Inductor's code for the composites spent more time than the GEMM. The
shape-generic compile serves the other devices.

Each op accepts inputs of any strides and returns contiguous outputs, as its fake implementation
declares.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import torch
from torch import Tensor
from torch._dynamo.utils import counters

from . import aten_impl, cpu_gemm, cpu_kernels, int8_gemm
from .hadamard import BLOCK, hadamard_matrix, lowpass_rows, padded_length, tail_basis, walsh_basis
from .quant import guard_scale, noise_offset, qmax, sawb_clip_of_moments

# Joint-graph passes installed in Inductor's global config (HOT's own among them) are for models'
# graphs, not for these kernels.
_KERNEL_INDUCTOR_OPTIONS = {"joint_custom_pre_pass": None, "joint_custom_post_pass": None}

_build_seconds = 0.0
_SPECIALIZE_SETTINGS = torch._dynamo.config.patch(specialize_int=True)


@torch.library.custom_op(
    "hot_compile::draw_seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def draw_seed(like: torch.Tensor) -> torch.Tensor:
    """A fresh int64 seed from the default generator of ``like``'s device (reproducible under
    ``torch.manual_seed``). ``like`` only places the op: in a joint graph it sits in the backward."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=like.device)


@draw_seed.register_fake
def _draw_seed_fake(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((), dtype=torch.int64)



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
    """Seconds this process has spent building the kernels of HOT's ops (the first call of each
    configuration, whole, and the CPU library): the part of a first training step that is not the
    model's compile."""
    return _build_seconds + cpu_kernels.build_seconds


def compiled_hq_grad_input(
    grad_output: Tensor,
    weight: Tensor,
    seed: Tensor,
    grad_bits: int,
    weight_bits: int,
    per_token: bool,
    hadamard: bool,
    weight_quantizer: str,
) -> Tensor:
    """:func:`hot_compile.runtime.aten_impl.hq_grad_input` by the shape-generic compile: ``[..., N] × [N, K] → [..., K]``."""
    return _run(
        aten_impl.hq_grad_input,
        grad_output,
        weight,
        seed,
        grad_bits=grad_bits,
        weight_bits=weight_bits,
        per_token=per_token,
        hadamard=hadamard,
        weight_quantizer=weight_quantizer,
    ).contiguous()


hq_grad_input = torch.library.custom_op("hot_compile::hq_grad_input", compiled_hq_grad_input, mutates_args=())


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


def compiled_compress_activation(x: Tensor, rank: int, bits: int, per_channel: bool) -> tuple[Tensor, Tensor]:
    """:func:`hot_compile.runtime.aten_impl.compress_activation` by the shape-generic compile: ``[..., K] →
    ([⌊r·L/16⌋ at most, K] int8, scale [1, K] or 0-d)``."""
    tail = _tail_basis(x, rank)
    x_q, scale = _run(aten_impl.compress_activation, x, tail, rank=rank, bits=bits, per_channel=per_channel)
    return x_q.contiguous(), scale.contiguous()


compress_activation = torch.library.custom_op(
    "hot_compile::compress_activation", compiled_compress_activation, mutates_args=()
)


@compress_activation.register_fake
def _(x, rank, bits, per_channel):
    rows = lowpass_rows(x.numel() // x.shape[-1], rank)
    scale_shape = (1, x.shape[-1]) if per_channel else ()
    return x.new_empty(rows, x.shape[-1], dtype=torch.int8), x.new_empty(scale_shape, dtype=torch.float32)


def compiled_hla_grad_weight(
    grad_output: Tensor,
    x_q: Tensor,
    x_scale: Tensor,
    seed: Tensor,
    rank: int,
    bits: int,
    per_channel: bool,
    out_dtype: torch.dtype,
) -> Tensor:
    """:func:`hot_compile.runtime.aten_impl.hla_grad_weight` by the shape-generic compile: ``[..., N]`` and the ABC buffer
    → ``[N, K]``."""
    tail = _tail_basis(grad_output, rank)
    return _run(
        aten_impl.hla_grad_weight,
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


hla_grad_weight = torch.library.custom_op("hot_compile::hla_grad_weight", compiled_hla_grad_weight, mutates_args=())


@hla_grad_weight.register_fake
def _(grad_output, x_q, x_scale, seed, rank, bits, per_channel, out_dtype):
    return grad_output.new_empty(grad_output.shape[-1], x_q.shape[1], dtype=out_dtype)


def compiled_int8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], bits: int) -> Tensor:
    """:func:`hot_compile.runtime.aten_impl.int8_linear` by the shape-generic compile: ``[..., K] × [N, K] → [..., N]``."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return _run(aten_impl.int8_linear, *tensors, bits=bits).contiguous()


int8_linear = torch.library.custom_op("hot_compile::int8_linear", compiled_int8_linear, mutates_args=())


@int8_linear.register_fake
def _(x, weight, bias, bits):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def compiled_encode_rows(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """:func:`hot_compile.runtime.aten_impl.encode_rows` by the shape-generic compile: ``[..., C] →
    ([..., C] int8, [..., 1] float32)``."""
    q, scale = _run(aten_impl.encode_rows, x, bits=bits)
    return q.contiguous(), scale.contiguous()


encode_rows = torch.library.custom_op("hot_compile::encode_rows", compiled_encode_rows, mutates_args=())


@encode_rows.register_fake
def _(x, bits):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def compiled_encode_derivative(x: Tensor, seed: Tensor, bits: int, function: str) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`hot_compile.runtime.aten_impl.encode_derivative` by the shape-generic compile: ``[..., C]
    → ([..., C/2] uint8, [..., 1] float32 lo, [..., 1] float32 step)``."""
    packed, lo, step = _run(aten_impl.encode_derivative, x, seed, bits=bits, function=function)
    return packed.contiguous(), lo.contiguous(), step.contiguous()


encode_derivative = torch.library.custom_op(
    "hot_compile::encode_derivative", compiled_encode_derivative, mutates_args=()
)


@encode_derivative.register_fake
def _(x, seed, bits, function):
    aten_impl.check_derivative(bits, function)
    side = (*x.shape[:-1], 1)
    packed = x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
    return packed, x.new_empty(side, dtype=torch.float32), x.new_empty(side, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ CPU kernels


def prepare(device: torch.device) -> None:
    """Start building what the ops need on ``device`` ahead of their first call: on the CPU, the
    library of :mod:`hot_compile.runtime.cpu_kernels` (in the background)."""
    if device.type == "cpu":
        cpu_kernels.prepare()


@functools.cache
def _basis(kind: str, rank: int = BLOCK) -> Tensor:
    """A ``[rank, 16]`` float32 basis of :func:`cpu_kernels.quantize_columns`."""
    if kind == "hadamard":
        return hadamard_matrix()
    if kind == "identity":
        return torch.eye(BLOCK)
    return walsh_basis(rank)


def _dequantized_product(
    a: Tensor, b: Tensor, a_bits: int, b_bits: int, row_scale: Tensor, col_scale: Tensor, divisor: int, out_dtype: torch.dtype, bias: Tensor | None = None
) -> Tensor:
    """:func:`cpu_gemm.matmul_dequantized` of ``a_bits``- and ``b_bits``-bit codes."""
    product = functools.partial(int8_gemm.int8_matmul, a_max=qmax(a_bits), b_max=qmax(b_bits))
    return cpu_gemm.matmul_dequantized(a, b, row_scale, col_scale, divisor, out_dtype, product, bias, b_max=qmax(b_bits))


def _quantize_by_columns(
    x2: Tensor,
    basis: Tensor,
    tail: Tensor | None,
    rows: int,
    bits: int,
    *,
    per_column: bool,
    stochastic: bool,
    offset: int = 0,
    column_major: bool = False,
) -> tuple[Tensor, Tensor]:
    """``x2`` transformed along its rows (:func:`cpu_kernels.quantize_columns`) and quantized at its max
    scale, one per column or one in all."""
    amax = cpu_kernels.column_amax(x2, basis, tail, rows)
    scale = guard_scale((amax if per_column else amax.amax()) / qmax(bits))
    q = cpu_kernels.quantize_columns(x2, basis, tail, rows, bits, scale, stochastic=stochastic, offset=offset, column_major=column_major)
    return q, scale


def _quantize_weight(weight: Tensor, width: int, bits: int, quantizer: str, hadamard: bool, seed: Tensor):
    """HQ's ``q(BW)`` (``[width, K]``) and its scale: :func:`hot_compile.runtime.aten_impl.hq_grad_input`'s weight side."""
    basis = _basis("hadamard" if hadamard else "identity")
    offset = noise_offset(seed, aten_impl.SALT_WEIGHT)
    if quantizer != "sawb":
        per_column = quantizer == "per_channel"
        return _quantize_by_columns(weight, basis, basis, width, bits, per_column=per_column, stochastic=True, offset=offset)
    amax, abs_sum, square_sum = cpu_kernels.column_moments(weight, basis, basis, width)
    count = width * weight.shape[1]
    scale = guard_scale(sawb_clip_of_moments(square_sum.sum() / count, abs_sum.sum() / count, amax.amax()) / qmax(bits))
    return cpu_kernels.quantize_columns(weight, basis, basis, width, bits, scale, stochastic=False), scale


@encode_rows.register_kernel("cpu")
def _(x, bits):
    return cpu_kernels.encode_rows(x, bits)


@encode_derivative.register_kernel("cpu")
def _(x, seed, bits, function):
    return cpu_kernels.encode_derivative(x, noise_offset(seed, aten_impl.SALT_DERIVATIVE), function, bits)


@hq_grad_input.register_kernel("cpu")
def _(grad_output, weight, seed, grad_bits, weight_bits, per_token, hadamard, weight_quantizer):
    n, k = weight.shape
    g2 = grad_output.reshape(-1, n)
    width = padded_length(n) if hadamard else n
    offset = noise_offset(seed, aten_impl.SALT_GRAD_INPUT)
    qg, sg = cpu_kernels.quantize_rows(g2, grad_bits, width=width, hadamard=hadamard, per_row=per_token, offset=offset)
    qw, sw = _quantize_weight(weight, width, weight_bits, weight_quantizer, hadamard, seed)
    out = _dequantized_product(qg, qw, grad_bits, weight_bits, sg, sw, BLOCK if hadamard else 1, grad_output.dtype)
    return out.view(*grad_output.shape[:-1], k)


def _lowpass_columns(x: Tensor, rank: int) -> tuple[Tensor, Tensor, int]:
    """``x`` as ``[L, K]``, and the basis, tail and row count of its rank-``rank`` low-pass projection."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2, _tail_basis(x2, rank), lowpass_rows(x2.shape[0], rank)


@compress_activation.register_kernel("cpu")
def _(x, rank, bits, per_channel):
    x2, tail, rows = _lowpass_columns(x, rank)
    q, scale = _quantize_by_columns(x2, _basis("walsh", rank), tail, rows, bits, per_column=per_channel, stochastic=False)
    return q, scale.view(1, -1) if per_channel else scale


@hla_grad_weight.register_kernel("cpu")
def _(grad_output, x_q, x_scale, seed, rank, bits, per_channel, out_dtype):
    g2, tail, rows = _lowpass_columns(grad_output, rank)
    offset = noise_offset(seed, aten_impl.SALT_GRAD_WEIGHT)
    basis = _basis("walsh", rank)
    # Column-major, so that q(P g)ᵀ reaches the product row-major: the GEMM packs it without byte
    # transposes, which cost HOT's VNNI GEMM more than the int32 round trip it saves (Zen 4).
    qg, scale = _quantize_by_columns(
        g2, basis, tail, rows, bits, per_column=per_channel, stochastic=True, offset=offset, column_major=True
    )
    # grad_W = q(P g)ᵀ q(P x): the rows of the product are g's channels, scaled by g's scales.
    return _dequantized_product(qg.t(), x_q, bits, bits, scale, x_scale.contiguous(), BLOCK, out_dtype)


@int8_linear.register_kernel("cpu")
def _(x, weight, bias, bits):
    n, k = weight.shape
    width = padded_length(k)
    rows = dict(bits=bits, width=width, hadamard=True, per_row=True, stochastic=False)
    qx, sx = cpu_kernels.quantize_rows(x.reshape(-1, k), **rows)
    qw, sw = cpu_kernels.quantize_rows(weight, **rows)
    out = _dequantized_product(qx, qw.t(), bits, bits, sx, sw, BLOCK, x.dtype, bias)
    return out.view(*x.shape[:-1], n)
