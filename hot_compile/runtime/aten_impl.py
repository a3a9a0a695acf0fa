"""The three composite operations of HOT, on real integer matmuls (int8 in, int32 accumulate).

Shapes follow a linear layer ``y = x Wᵀ + b``: ``x: [..., K]``, ``W: [N, K]``, upstream gradient
``g: [..., N]``; ``L`` is the product of the leading dims. All arithmetic before the integer matmul is
float32 whatever the input dtype (fp32, bf16, fp16); results come back in the requested dtype.
These functions are plain aten code: :mod:`hot_compile.runtime.ops` defines the custom ops the graph
pass inserts, and on devices without their own kernels runs these compiled by Inductor, which fuses
each scale reduction with its quantizer.
"""

from __future__ import annotations

import torch

from .hadamard import BLOCK, block_hadamard, lowpass, tail_basis
from .int8_gemm import int8_matmul
from .quant import pack_nibbles, qmax, quantize_nearest, quantize_range_stochastic, quantize_sawb, quantize_stochastic

# Distinct noise streams for the stochastic quantizers of one linear layer sharing a seed; the saved
# derivative's code draws a seed of its own.
SALT_GRAD_INPUT = 1
SALT_GRAD_WEIGHT = 2
SALT_WEIGHT = 3
SALT_DERIVATIVE = 0

DEFAULT_GX_BITS = 8
DEFAULT_GW_BITS = 8
DEFAULT_FORWARD_BITS = 8
# The full Walsh basis: no low-rank cut unless calibration shows neighbouring tokens are alike.
DEFAULT_RANK = 16


def hq_grad_input(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    seed: torch.Tensor,
    *,
    grad_bits: int = DEFAULT_GX_BITS,
    weight_bits: int = DEFAULT_GX_BITS,
    per_token: bool = True,
    hadamard: bool = True,
    weight_quantizer: str = "per_channel",
) -> torch.Tensor:
    """grad_input of a linear by Hadamard quantization (HQ).

    ``g W = (g B)(B W) / 16`` with ``B = blockdiag(H16, …)`` along N, so
    ``grad_x ≈ int_mm(q(gB), q(BW)) · s_g · s_w / 16``: ``q(gB)`` stochastic, one scale per token
    (``per_token``) or per tensor; ``q(BW)`` by ``weight_quantizer``:

    * ``"per_channel"``: stochastic, one max scale per column of ``BW`` (per input feature ``k``);
    * ``"stochastic"``: stochastic, one max scale;
    * ``"sawb"``: SAWB's clip and round-to-nearest (the paper's; a bias no number of steps removes).

    Scales on ``L`` and ``K``, the dimensions the product does not contract, factor out of the integer
    GEMM. The stochastic choices make ``E[q(gB)·s_g] = gB`` and ``E[q(BW)·s_w] = BW``, so the product is
    unbiased. Returns ``[..., K]`` in ``grad_output``'s dtype. ``hadamard=False`` quantizes ``g`` and
    ``W`` as they are (plain integer quantization, the ablation baseline).
    """
    n, k = weight.shape
    g2 = grad_output.reshape(-1, n).float()
    w = weight.float()
    if hadamard:
        g2, w = block_hadamard(g2, 1), block_hadamard(w, 0)
    qg, sg = quantize_stochastic(g2, grad_bits, seed, dim=-1 if per_token else None, salt=SALT_GRAD_INPUT)
    if weight_quantizer == "sawb":
        qw, sw = quantize_sawb(w, weight_bits)
    else:
        per_column = 0 if weight_quantizer == "per_channel" else None
        qw, sw = quantize_stochastic(w, weight_bits, seed, dim=per_column, salt=SALT_WEIGHT)
    norm = BLOCK if hadamard else 1
    out = int8_matmul(qg, qw, qmax(grad_bits), qmax(weight_bits)).to(torch.float32) * (sg * (sw / norm))
    return out.to(grad_output.dtype).reshape(*grad_output.shape[:-1], k)


def _lowpass(x2: torch.Tensor, rank: int, tail: torch.Tensor | None) -> torch.Tensor:
    if tail is None:
        tail = tail_basis(x2.shape[0] % BLOCK, rank, device=x2.device)
    return lowpass(x2.float(), rank, tail)


def compress_activation(
    x: torch.Tensor,
    tail: torch.Tensor | None = None,
    *,
    rank: int = DEFAULT_RANK,
    bits: int = DEFAULT_GW_BITS,
    per_channel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation buffer compression (ABC): ``x → (q(P_L x), s_x)``, round-to-nearest.

    ``P_L`` (:func:`hot_compile.runtime.hadamard.lowpass`) keeps the ``rank`` lowest-sequency Walsh rows of
    each block of 16 tokens, and proportionally fewer of the ``L mod 16`` left over, so the int8 result
    is ``[⌊r·L/16⌋, K]`` at most: ``r/64`` of the bytes of a float32 ``x`` (1/8 at r = 8, 1/4 at
    r = 16) at any L. ``s_x`` is one scale per channel (``[1, K]``: an outlier channel keeps its own
    range and leaves the others their 8 bits) or, without ``per_channel``, one per tensor.
    ``tail`` is ``tail_basis(L mod 16, rank)``, built here when not given.
    """
    x2 = x.reshape(-1, x.shape[-1])
    return quantize_nearest(_lowpass(x2, rank, tail), bits, dim=0 if per_channel else None)


def hla_grad_weight(
    grad_output: torch.Tensor,
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    seed: torch.Tensor,
    tail: torch.Tensor | None = None,
    *,
    rank: int = DEFAULT_RANK,
    bits: int = DEFAULT_GW_BITS,
    per_channel: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """grad_weight of a linear by Hadamard low-rank approximation (HLA).

    ``gᵀ x ≈ (P_L g)ᵀ (P_L x) / 16`` (exact at r = 16), so
    ``grad_W ≈ int_mm(q(P_L g)ᵀ, q(P_L x)) · s_g · s_x / 16`` with ``q(P_L g)`` stochastic, one scale
    per output channel ``n`` (``per_channel``) or per tensor, and ``(q(P_L x), s_x)`` from
    :func:`compress_activation` at the same ``rank`` (and ``tail``). Returns ``[N, K]``.
    """
    g2 = grad_output.reshape(-1, grad_output.shape[-1])
    qg, sg = quantize_stochastic(
        _lowpass(g2, rank, tail), bits, seed, dim=0 if per_channel else None, salt=SALT_GRAD_WEIGHT
    )
    # sg is [1, N] (or 0-d): as a column it scales the rows of the [N, K] product.
    out = int8_matmul(qg.t(), x_q, qmax(bits), qmax(bits)).to(torch.float32) * (sg.t() * (x_scale / BLOCK))
    return out.to(out_dtype or grad_output.dtype)


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, bits: int = DEFAULT_FORWARD_BITS
) -> torch.Tensor:
    """The forward product of a linear, ``x Wᵀ + b``, on integer operands (HOT itself leaves the forward
    exact; this is the option ``HotConfig.forward_bits``).

    ``x Wᵀ = (x B)(W B)ᵀ / 16`` with ``B = blockdiag(H16, …)`` along ``K``, so
    ``y ≈ int_mm(q(xB), q(WB)ᵀ) · s_x · s_w / 16 + b``. Both operands are rounded to nearest (a forward
    value, not a gradient estimate: no noise), with one scale per token of ``x`` and one per output
    feature of ``W``: the dimensions the product does not contract, so the scales factor out of the
    integer GEMM. The transform spreads an outlier feature over its block of 16 before the scales are
    taken. Returns ``[..., N]`` in ``x``'s dtype.
    """
    n, k = weight.shape
    x2 = block_hadamard(x.reshape(-1, k).float(), 1)
    w = block_hadamard(weight.float(), 1)
    qx, sx = quantize_nearest(x2, bits, dim=-1)
    qw, sw = quantize_nearest(w, bits, dim=-1)
    out = int8_matmul(qx, qw.t(), qmax(bits), qmax(bits)).to(torch.float32) * (sx * (sw.t() / BLOCK))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def encode_rows(x: torch.Tensor, *, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A saved activation as int8 rows: round to nearest, one float32 scale per row."""
    return quantize_nearest(x, bits, dim=-1)


def _gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x * 0.7071067811865476)) + x * torch.exp(-0.5 * x * x) * 0.3989422804014327


def _gelu_tanh_derivative(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(0.7978845608028654 * (x + 0.044715 * x**3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * x * x)


# The derivatives the derivative code computes from the saved input itself: GELU's (``approximate=
# "none"``) and GELU's with ``approximate="tanh"``. ``GIVEN``: the input is the derivative.
DERIVATIVES = {"gelu": _gelu_derivative, "gelu_tanh": _gelu_tanh_derivative}
GIVEN = "given"


def derivative_of(function: str):
    """``DERIVATIVES[function]``; a ValueError that names the choices for another name."""
    if function not in DERIVATIVES:
        raise ValueError(f"no derivative {function!r}: one of {', '.join(map(repr, DERIVATIVES))}, or {GIVEN!r} to code a given one")
    return DERIVATIVES[function]


def check_derivative(bits: int, function: str) -> None:
    if bits != 4:
        raise ValueError(f"the derivative code packs two 4-bit codes a byte, got bits={bits}")
    if function != GIVEN:
        derivative_of(function)


def encode_derivative(
    x: torch.Tensor, seed: torch.Tensor, *, bits: int, function: str = GIVEN
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A derivative's values as 4-bit codes over each row's range (stochastic rounding), two a byte,
    with the rows' ``lo`` and ``step``: of ``x`` itself (``function=GIVEN``), or of
    ``DERIVATIVES[function]`` evaluated on ``x`` in float32."""
    check_derivative(bits, function)
    value = x if function == GIVEN else DERIVATIVES[function](x.float())
    codes, lo, step = quantize_range_stochastic(value, bits, seed, salt=SALT_DERIVATIVE)
    return pack_nibbles(codes), lo, step
