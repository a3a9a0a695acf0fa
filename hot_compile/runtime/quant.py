"""Integer quantizers (2..8 bits) that return int8 values plus float32 scale(s).

Every quantizer here obeys three rules the method depends on:

* an all-zero input quantizes to zeros with a finite scale (the scale is guarded, never divided by 0);
* a NaN or Inf anywhere in the input makes the scale non-finite, so every dequantized product that
  touches it is non-finite too (AMP's ``GradScaler`` detects overflow this way);
* the stochastic quantizers are unbiased: ``E[q · s] = v`` exactly.

The uniform noise of stochastic rounding comes from an integer hash of the element index and a seed
tensor instead of a random-number op: it fuses into the quantization kernel under Inductor and a new
seed does not recompile.
"""

from __future__ import annotations

import torch

MIN_BITS = 2
MAX_BITS = 8

# Odd multipliers of 32-bit words.
_MIX_A = 0x7FEB352D
_MIX_B = 0x2C1B3C6D
# Not −_SEED_MULT (the golden ratio, 0x9E3779B9): the next seed would then shift the stream by one element.
_INDEX_MULT = 0x85EBCA6B
_SEED_MULT = 0x61C88647
_SALT_MULT = 0x3C6EF372

# SAWB clipping coefficients of the reference implementation: clip = c1·sqrt(E[v²]) − c2·E[|v|].
SAWB_C1 = 12.1
SAWB_C2 = 12.2


def qmax(bits: int) -> int:
    """Largest integer level of a symmetric ``bits``-bit quantizer: ``2**(bits-1) - 1``."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    return 2 ** (bits - 1) - 1


def guard_scale(scale: torch.Tensor) -> torch.Tensor:
    """Replace a zero scale by 1 (its tensor quantizes to zeros anyway); NaN and Inf pass through."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _int32(value: int) -> int:
    """The signed 32-bit integer with the same low 32 bits as ``value``."""
    return (value + 2**31) % 2**32 - 2**31


def _shr32(h: torch.Tensor, bits: int) -> torch.Tensor:
    # Logical right shift of 32-bit words held in int32: the arithmetic shift, with the copies of the
    # sign bit masked off.
    return (h >> bits) & ((1 << (32 - bits)) - 1)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    # int32 multiplication wraps modulo 2**32, which is the 32-bit arithmetic the finalizer wants.
    h = h ^ _shr32(h, 16)
    h = h * _MIX_A
    h = h ^ _shr32(h, 15)
    h = h * _MIX_B
    return h ^ _shr32(h, 16)


def hash_uniform(like: torch.Tensor, seed: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """Float32 noise in ``[0, 1)`` of ``like``'s shape, a pure function of (element index, seed, salt).

    Each hash gives the noise of two elements: the flat indices ``32a + c`` and ``32a + 16 + c``
    (``c < 16``) share the word ``w = 16a + c``, ``h = mix32(w·P + seed·A + salt·B)``, and take its low
    and its high 16 bits: ``u = ((h >> (index & 16)) & 0xffff) · 2⁻¹⁶``. ``mix32`` is a xor-shift/multiply
    finalizer on 32-bit words; ``seed`` is an integer scalar tensor; ``salt`` separates the noise of
    different quantizers that share a seed. A native kernel computes 16 hashes for 32 consecutive
    values, half the multiplies of a hash a value (the hash was most of a stochastic quantizer's time).
    16 bits of noise leave stochastic rounding's bias below 2⁻¹⁶ of a level.

    One round of ``mix32`` on consecutive words leaves the noise of elements a row of a wide layer
    apart visibly dependent (pairs 3072 apart: χ² up to 48178 on 1023 degrees of freedom, against
    about 1023 for independent noise); the odd ``P`` spreads the indices so that no such pair of
    words is close. A second round of ``mix32`` does the same with eleven operations instead of one,
    and doubles the time Inductor takes to compile a stochastic quantizer (HQ's alone: 4.5–5.9 s against
    2.3–2.7 s; the whole HQ op: 8.0 s against 7.2 s, medians of six cold builds).

    The words are computed in int32 lanes (wrapping arithmetic, logical shifts by masking), twice as
    many per vector register as int64, for the same values as the 32-bit formula.
    """
    index = torch.arange(like.numel(), device=like.device, dtype=torch.int64).to(torch.int32).view(like.shape)
    offset = seed.to(torch.int64).to(torch.int32) * _SEED_MULT + _int32(salt * _SALT_MULT)
    word = (_shr32(index, 1) & ~15) | (index & 15)
    h = _mix32(word * _int32(_INDEX_MULT) + offset)
    return ((h >> (index & 16)) & 0xFFFF).to(torch.float32) * (1.0 / (1 << 16))


def noise_offset(seed: torch.Tensor | int, salt: int) -> int:
    """The word :func:`hash_uniform` adds to each element's hashed index, ``seed·SEED_MULT +
    salt·SALT_MULT`` mod 2³², as a Python int: what a native kernel of the same noise takes."""
    return (int(seed) * _SEED_MULT + salt * _SALT_MULT) % 2**32


def _amax(mag: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``max|v|`` over the whole tensor (0-d), or over ``dim`` kept as a size-1 dimension."""
    return mag.amax() if dim is None else mag.amax(dim=dim, keepdim=True)


def quantize_stochastic(
    v: torch.Tensor, bits: int, seed: torch.Tensor, *, dim: int | None = None, salt: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased stochastic rounding: ``s = max|v| / qmax``; ``q = sign(v)·floor(|v|/s + u)``.

    ``dim=None`` gives one scale for the tensor (0-d); ``dim=d`` takes the max over dimension ``d``,
    one scale per slice across it (shape 1 along ``d``): for a matmul operand, ``d`` is the contracted
    dimension, so the scales factor out of the integer product (``dim=-1`` of ``g [L, N]`` is one
    scale per token).
    """
    qm = qmax(bits)
    v = v.float()
    mag = v.abs()
    scale = guard_scale(_amax(mag, dim) / qm)
    level = torch.floor(mag / scale + hash_uniform(v, seed, salt))
    q = (torch.sign(v) * level).clamp(-qm, qm).to(torch.int8)
    return q, scale


def quantize_nearest(v: torch.Tensor, bits: int, *, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest: ``s = max|v| / qmax``; ``q = round(v · (1/s))``, the reciprocal's product
    as HOT's CPU kernels take it (a division per value would be the slowest instruction of their
    loops); scales as in :func:`quantize_stochastic`."""
    qm = qmax(bits)
    v = v.float()
    scale = guard_scale(_amax(v.abs(), dim) / qm)
    return torch.round(v * scale.reciprocal()).clamp(-qm, qm).to(torch.int8), scale


def sawb_clip(v: torch.Tensor) -> torch.Tensor:
    """SAWB clipping value ``12.1·sqrt(mean(v²)) − 12.2·mean(|v|)``, capped at ``max|v|``.

    For near-constant data the formula goes non-positive; ``max|v|`` is used then. A NaN or Inf in
    ``v`` gives a non-finite clip.
    """
    v = v.float()
    mag = v.abs()
    return sawb_clip_of_moments((v * v).mean(), mag.mean(), mag.amax())


def sawb_clip_of_moments(mean_square: torch.Tensor, mean_abs: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """:func:`sawb_clip` from ``E[v²]``, ``E[|v|]`` and ``max|v|``."""
    clip = SAWB_C1 * torch.sqrt(mean_square) - SAWB_C2 * mean_abs
    return torch.where(clip > 0, torch.minimum(clip, amax), amax)


def quantize_sawb(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SAWB: per-tensor scale ``clip / qmax``, values clipped to ``±clip``, round-to-nearest."""
    qm = qmax(bits)
    v = v.float()
    scale = guard_scale(sawb_clip(v) / qm)
    return torch.round(v / scale).clamp(-qm, qm).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale


def quantize_range_stochastic(
    v: torch.Tensor, bits: int, seed: torch.Tensor, *, salt: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unsigned ``bits``-bit codes of ``v`` over each row's range, unbiased, with 0 one of the levels.

    ``step = (max(row) − min(row)) / (2^bits − 2)`` and ``lo = step·⌊min(row) / step⌋``, so the
    levels ``lo + q·step`` (``q`` in ``0..2^bits − 1``) cover the row and include 0: a value of 0 (a
    saturated GELU's derivative) is coded exactly, not as noise between two levels. ``q = ⌊(v − lo) ·
    (1/step) + u⌋``, the reciprocal's product as HOT's CPU kernel takes it; ``E[lo + q·step] = v`` and
    every error is below one step. Returns uint8 codes (one per value) and float32 ``lo``, ``step`` of
    shape 1 along the last dimension."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in 2..{MAX_BITS}, got {bits!r}")
    top = 2**bits - 1
    v = v.float()
    least = v.amin(dim=-1, keepdim=True)
    step = guard_scale((v.amax(dim=-1, keepdim=True) - least) / (top - 1))
    lo = torch.floor(least / step) * step
    q = torch.floor((v - lo) * step.reciprocal() + hash_uniform(v, seed, salt)).clamp(0, top).to(torch.uint8)
    return q, lo, step


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte along the last dimension (of even size ``2n``): element ``i`` in the low
    nibble of byte ``i``, element ``n + i`` in its high one. Halves rather than neighbours: the
    decoding is then two contiguous halves, which Inductor vectorizes (neighbours took it 3.5× as
    long, an index parity per element)."""
    n = q.shape[-1] // 2
    return q[..., :n] | (q[..., n:] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The codes :func:`pack_nibbles` packed, as uint8 of twice the last dimension.

    Each byte shifted by 0 and by 4 along a new axis, then that axis joined to the last: a broadcast
    and a view, which Inductor fuses into the decode's reader. A ``cat`` of the two halves ran as
    ATen's, writing the codes out first (19 MB at a [6272, 3072] GELU input): decoding and multiplying
    a gradient there took 1.2–1.3× as long."""
    shifts = (torch.arange(2, dtype=torch.uint8, device=packed.device) * 4).view(2, 1)
    return ((packed.unsqueeze(-2) >> shifts) & 15).flatten(-2)
