"""Cost model of one backward matmul site: the original product vs its HOT variant.

Pure functions of integer shapes and a :class:`~hot_compile.runtime.devices.DeviceProfile`; nothing here looks
at a graph. Notation: a linear ``y = x Wᵀ`` with ``x: [L, K]``, ``W: [N, K]``; ``b`` the bytes per
element of the float dtype; ``Np = 16·⌈N/16⌉``; ``Lr`` the projected token count at rank r, at most
``⌊r·L/16⌋`` (:func:`~hot_compile.runtime.hadamard.lowpass_rows`).
Profile rates: ``F`` float matmul FLOP/s of the dtype, ``I`` integer OP/s at the site's bit width
(:meth:`~hot_compile.runtime.devices.DeviceProfile.int8_rate`), ``R`` read bytes/s, ``W`` write bytes/s
of a new buffer of that size (:meth:`~hot_compile.runtime.devices.DeviceProfile.write_seconds`: slower
above glibc's mmap threshold on CPUs, where each page of a fresh mapping faults),
``T`` fused transform+quantize outputs/s, ``S`` values/s of a stochastic code without a transform
(``T`` where the profile has no such rate), ``c`` seconds per kernel call, ``o`` seconds per HOT op
call beyond its kernels (dispatch, and the cold caches it meets in a step).
"""

from __future__ import annotations

import dataclasses
import math

from ..runtime.conv_ops import WINDOW_BYTES
from ..runtime.devices import DeviceProfile
from ..runtime.hadamard import BLOCK, lowpass_rows


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class SiteCost:
    """Estimated seconds of the original and the HOT variant, and saved-activation bytes."""

    original_s: float
    hot_s: float
    saved_bytes_before: int | None = None
    saved_bytes_after: int | None = None

    @property
    def speedup(self) -> float:
        return self.original_s / self.hot_s if self.hot_s > 0 else float("inf")


def matmul_time(m: int, k: int, n: int, elem_bytes: int, profile: DeviceProfile, flops: float) -> float:
    """``2·m·k·n / F + m·n·b / W + c``: a float ``[m, k] @ [k, n]`` writing a fresh output."""
    return 2 * m * k * n / flops + profile.write_seconds(m * n * elem_bytes) + profile.kernel_overhead


def quantize_time(rows: int, cols: int, out_elems: int, elem_bytes: int, profile: DeviceProfile) -> float:
    """Scale reduction then fused transform + quantize of a ``[rows, cols]`` operand into
    ``out_elems`` int8 values: ``2·rows·cols·b / R + out / T + out / W + 2c``."""
    return (
        2 * rows * cols * elem_bytes / profile.read_bw
        + out_elems / profile.transform_rate
        + profile.write_seconds(out_elems)
        + 2 * profile.kernel_overhead
    )


def int_matmul_time(m: int, k: int, n: int, out_elem_bytes: int, profile: DeviceProfile, bits: int) -> float:
    """``2·m·k·n / I`` for the int32 product of ``bits``-bit operands, written ``m·n·4 / W`` in row
    chunks of a few MiB that the allocator reuses, then dequantize: ``m·n·4 / R + m·n·b_out / W``, 2 calls.
    Where the profile's product dequantizes as it goes (``int8_fused_epilogue``): ``2·m·k·n / I +
    m·n·b_out / W``, 1 call."""
    out = 2 * m * k * n / profile.int8_rate(bits) + profile.write_seconds(m * n * out_elem_bytes)
    if profile.int8_fused_epilogue:
        return out + profile.kernel_overhead
    return out + m * n * 4 / profile.write_bw + m * n * 4 / profile.read_bw + 2 * profile.kernel_overhead


def grad_input_cost(
    l: int, n: int, k: int, elem_bytes: int, flops: float, profile: DeviceProfile, bits: int
) -> SiteCost:
    """grad_input ``[L, N] @ [N, K]`` with ``bits``-bit HQ operands.

    original = ``2LNK/F + LKb/W + c``;
    HQ = quantize(g: L×N → L·Np) + quantize(W: N×K → Np·K) + ``2·L·Np·K/I`` + dequantize(L×K) + ``o``.
    """
    np_ = BLOCK * _ceil_div(n, BLOCK)
    hot = (
        profile.op_overhead
        + quantize_time(l, n, l * np_, elem_bytes, profile)
        + quantize_time(n, k, np_ * k, elem_bytes, profile)
        + int_matmul_time(l, np_, k, elem_bytes, profile, bits)
    )
    return SiteCost(matmul_time(l, n, k, elem_bytes, profile, flops), hot)


def compressed_bytes(l: int, k: int, rank: int) -> int:
    """Bytes of the ABC buffer: ``Lr·K`` int8 plus a 4-byte scale."""
    return lowpass_rows(l, rank) * k + 4


def grad_weight_cost(
    l: int, n: int, k: int, rank: int, elem_bytes: int, flops: float, profile: DeviceProfile, bits: int
) -> SiteCost:
    """grad_weight ``[N, L] @ [L, K]`` with its activation, ``bits``-bit HLA operands.

    original = ``2NLK/F + NKb/W + c``, saving ``L·K·b`` bytes of ``x``;
    HLA+ABC = quantize(g: L×N → Lr·N) + ``2·N·Lr·K/I`` + dequantize(N×K)
    + the forward's compression quantize(x: L×K → Lr·K) + ``2o`` (two ops: HLA and the compression),
    saving ``Lr·K + 4`` bytes.
    """
    lr = lowpass_rows(l, rank)
    hot = (
        2 * profile.op_overhead
        + quantize_time(l, n, lr * n, elem_bytes, profile)
        + int_matmul_time(n, lr, k, elem_bytes, profile, bits)
        + quantize_time(l, k, lr * k, elem_bytes, profile)
    )
    return SiteCost(
        matmul_time(n, l, k, elem_bytes, profile, flops),
        hot,
        saved_bytes_before=l * k * elem_bytes,
        saved_bytes_after=compressed_bytes(l, k, rank),
    )


def saved_compression_cost(
    numel: int,
    rows: int,
    elem_bytes: int,
    code_bits: int,
    scales: int,
    profile: DeviceProfile,
    derivative_bytes: int | None = None,
) -> SiteCost:
    """A saved activation of ``numel`` values in ``rows`` rows, kept as ``code_bits``-bit codes with
    ``scales`` float32 numbers a row (:mod:`~hot_compile.passes.saved_activations`) instead of ``b``
    bytes a value; ``p = numel·code_bits/8 + 4·scales·rows`` bytes. ``derivative_bytes`` (``c``): None
    for a code of the value itself, rounded to nearest; for the stochastic code of a derivative ``f(x)``
    saved in place of ``x``, the bytes a value of the ``f(x)`` buffer the forward writes for the
    encoder, or 0 where the encoder computes ``f(x)`` from ``x`` itself.

    original = 0: the tensor is written in the forward and read in the backward either way, and a
    derivative's evaluation moves from the backward into the forward (charged on neither side);
    coded = the forward's row reductions ``numel·e / R`` (``e = c`` for a written derivative, else
    ``b``) and rounding, ``numel·e / R`` to nearest or ``numel / S`` stochastically
    (:meth:`~hot_compile.runtime.devices.DeviceProfile.stochastic_code_seconds`), ``+ p / W`` + the
    backward's decoding ``p / R`` + ``2c`` + ``o`` (the encoder is one of HOT's ops); a value's code
    adds its decoded write ``numel·b / W``, a derivative's the write of its buffer ``numel·c / W`` and
    no decoded write (its only readers multiply it by a gradient, and Inductor decodes it inside that
    multiply); saving ``numel·b − p`` bytes.
    """
    packed = numel * code_bits // 8 + 4 * scales * rows
    read = numel * (derivative_bytes or elem_bytes) / profile.read_bw
    if derivative_bytes is None:
        rounding, written = read, profile.write_seconds(numel * elem_bytes)
    else:
        rounding, written = profile.stochastic_code_seconds(numel), profile.write_seconds(numel * derivative_bytes)
    hot = (
        read
        + rounding
        + profile.write_seconds(packed)
        + packed / profile.read_bw
        + written
        + 2 * profile.kernel_overhead
        + profile.op_overhead
    )
    return SiteCost(0.0, hot, saved_bytes_before=numel * elem_bytes, saved_bytes_after=packed)


def recompute_cost(numel: int, source_bytes: int, elem_bytes: int, profile: DeviceProfile) -> SiteCost:
    """A saved value of ``numel`` values of ``b`` bytes computed from a parameter of ``a`` bytes a value
    by casts and views (:mod:`~hot_compile.passes.saved_casts`), redone in the backward instead of saved.

    original = 0: the forward computes it for its own product either way, and the backward reads it
    either way; recomputed = ``numel·a / R + numel·b / W + c`` (the parameter read, the value written,
    one kernel); saving all ``numel·b`` bytes.
    """
    hot = numel * source_bytes / profile.read_bw + profile.write_seconds(numel * elem_bytes) + profile.kernel_overhead
    return SiteCost(0.0, hot, saved_bytes_before=numel * elem_bytes, saved_bytes_after=0)


def attention_flops(b: int, h: int, l: int, s: int, e: int, ev: int, backward: bool, causal: bool) -> int:
    """A fused attention of ``B·H`` heads, ``L`` queries and ``S`` keys of width ``E``, values of width
    ``Ev``: forward ``2·B·H·L·S·(E + Ev)`` (``QKᵀ``, then ``PV``), backward ``2·B·H·L·S·(3E + 2Ev)``
    (the scores again, ``dP``, ``dV``, ``dQ``, ``dK``), as ``torch.utils.flop_counter`` counts them;
    half of that where the mask is causal, whose kernels skip the blocks above the diagonal."""
    flops = 2 * b * h * l * s * ((3 * e + 2 * ev) if backward else (e + ev))
    return flops // 2 if causal else flops


def saved_traffic_time(nbytes: int, profile: DeviceProfile) -> float:
    """``n / W + n / R``: a value of ``n`` bytes the forward writes for the backward, which reads it."""
    return profile.write_seconds(nbytes) + nbytes / profile.read_bw


def forward_cost(l: int, n: int, k: int, elem_bytes: int, flops: float, profile: DeviceProfile, bits: int) -> SiteCost:
    """forward ``[L, K] @ [K, N]`` with ``bits``-bit operands (``HotConfig.forward_bits``): HQ's
    costs with the roles of ``N`` and ``K`` exchanged, the contraction being ``K``.

    original = ``2LKN/F + LNb/W + c``;
    INT = quantize(x: L×K → L·Kp) + quantize(W: N×K → N·Kp) + ``2·L·Kp·N/I`` + dequantize(L×N) + ``o``.
    """
    return grad_input_cost(l, k, n, elem_bytes, flops, profile, bits)


def conv_windows(t: int, k: int, elem_bytes: int) -> int:
    """Windows the conv ops split ``T`` tokens of ``K``-wide patches into: ``⌈T·K·b / WINDOW_BYTES⌉``
    (an upper bound: windows hold whole output rows)."""
    return max(1, _ceil_div(t * k * elem_bytes, WINDOW_BYTES))


def _tokens_major(t: int, n: int, elem_bytes: int, profile: DeviceProfile) -> float:
    """``g`` from ``[B, N, Ho, Wo]`` to ``[T, N]``: ``T·N·b/R + T·N·b/W + c``."""
    return t * n * elem_bytes / profile.read_bw + profile.write_seconds(t * n * elem_bytes) + profile.kernel_overhead


def conv_grad_input_cost(
    t: int, n: int, k: int, in_elems: int, offsets: int, elem_bytes: int, flops: float, profile: DeviceProfile, bits: int
) -> SiteCost:
    """grad_input of a groups-1 convolution, the patch linear ``[T, N] @ [N, K]`` (``N`` output channels,
    ``K = kh·kw·Cin``, ``offsets = kh·kw``) folded onto an input of ``in`` elements, with ``bits``-bit HQ
    operands, in ``w`` windows (:func:`conv_windows`).

    original = ``2TNK/F + in·b/W + c`` (a direct convolution, no patch matrix);
    HQ = the linear's HQ of ``(T, N, K)``, writing the patches, + the weight quantized again and one more
    op in each later window (``(w−1)·(quantize(N×K) + o)``) + ``g`` to tokens-major + the fold: the
    patches read, a float32 accumulator read and written per offset (``T·K·(b + 8)/R``, ``offsets·w``
    calls) and zeroed, cast and permuted (``in·4/W + in·4/R + in·b/W + 2c``).
    """
    windows = conv_windows(t, k, elem_bytes)
    np_ = BLOCK * _ceil_div(n, BLOCK)
    hq = grad_input_cost(t, n, k, elem_bytes, flops, profile, bits).hot_s
    later_windows = (windows - 1) * (quantize_time(n, k, np_ * k, elem_bytes, profile) + profile.op_overhead)
    fold = (
        t * k * (elem_bytes + 8) / profile.read_bw
        + offsets * windows * profile.kernel_overhead
        + profile.write_seconds(in_elems * 4)
        + in_elems * 4 / profile.read_bw
        + profile.write_seconds(in_elems * elem_bytes)
        + 2 * profile.kernel_overhead
    )
    original = 2 * t * n * k / flops + profile.write_seconds(in_elems * elem_bytes) + profile.kernel_overhead
    return SiteCost(original, hq + later_windows + _tokens_major(t, n, elem_bytes, profile) + fold)


def conv_grad_weight_cost(
    t: int,
    n: int,
    k: int,
    in_shape: tuple[int, ...],
    rank: int,
    elem_bytes: int,
    flops: float,
    profile: DeviceProfile,
    bits: int,
) -> SiteCost:
    """grad_weight of a groups-1 convolution, the patch linear ``[N, T] @ [T, K]``, with ``bits``-bit
    HLA operands, in ``w`` windows (:func:`conv_windows` of float32 patches); the forward saves its input ``x: in_shape``
    (``in`` elements, ``Cin = in_shape[1]``) in int8 rather than the patches.

    original = ``2NTK/F + NKb/W + c``, saving ``in·b`` bytes of ``x``;
    HLA = the forward's int8 compression of ``x`` (``2·in·b/R + in/W + c``) + the backward's padded
    channels-last int8 copy (``in/R + in/W + c``) + the int8 patches gathered and dequantized through
    float32 (``T·K·6/R + T·K·(5 + b)/W + 3w·c``) + ``g`` to tokens-major + the linear's HLA+ABC of
    ``(T, N, K)`` + per later window two more ops, and each window's ``N×K`` float32 product added to
    the total (``w·N·K·8/R + (w−1)·2o``), saving ``in + 4·Cin`` bytes.
    """
    in_elems = math.prod(in_shape)
    windows = conv_windows(t, k, 4)
    compress = 2 * in_elems * elem_bytes / profile.read_bw + profile.write_seconds(in_elems) + profile.kernel_overhead
    pad = in_elems / profile.read_bw + profile.write_seconds(in_elems) + profile.kernel_overhead
    # Each window's patches are a buffer of at most WINDOW_BYTES, which the allocator reuses.
    gather = t * k * 6 / profile.read_bw + t * k * (5 + elem_bytes) / profile.write_bw + 3 * windows * profile.kernel_overhead
    totals = windows * n * k * 8 / profile.read_bw + (windows - 1) * 2 * profile.op_overhead
    hla = grad_weight_cost(t, n, k, rank, elem_bytes, flops, profile, bits)
    return SiteCost(
        hla.original_s,
        hla.hot_s + compress + pad + gather + _tokens_major(t, n, elem_bytes, profile) + totals,
        saved_bytes_before=in_elems * elem_bytes,
        saved_bytes_after=in_elems + 4 * in_shape[1],
    )
