"""The three composite operations of HOT, on real integer matmuls (int8 in, int32 accumulate).

Shapes follow a linear layer ``y = x Wᵀ + b``: ``x: [..., K]``, ``W: [N, K]``, upstream gradient
``g: [..., N]``; ``L`` is the product of the leading dims. All arithmetic before the integer matmul is
float32 whatever the input dtype (fp32, bf16, fp16); results come back in the requested dtype.
These functions are plain aten code; :mod:`hot_compile.kernels` compiles them with Inductor, which
fuses each scale reduction with its quantizer, and wraps them as the custom ops the graph pass
inserts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .hadamard import BLOCK, block_hadamard, lowpass, tail_basis
from .quant import qmax, quantize_nearest, quantize_sawb, quantize_stochastic

# Distinct noise streams for the two stochastic quantizers of one linear layer sharing a seed.
SALT_GRAD_INPUT = 1
SALT_GRAD_WEIGHT = 2
SALT_WEIGHT = 3

DEFAULT_GX_BITS = 4
DEFAULT_GW_BITS = 8
DEFAULT_RANK = 8


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


# float32 holds every integer up to 2**24 exactly.
FLOAT32_EXACT = 2**24
# The largest |a_ik · b_kj| of two int8 operands: (-128)².
INT8_MAX_PRODUCT = 128 * 128
# Read once: Dynamo does not trace into torch.cpu's feature queries.
_CPU_HAS_INT8_GEMM = torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()


def native_int8_matmul(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` has fast kernels on ``device``: GPUs, and CPUs with AVX512-VNNI or
    AMX, where oneDNN runs int8 GEMMs in hardware. On other CPUs (AVX2 only) oneDNN's int8 path runs
    about 30× slower than an fp32 matmul of the same shape, and :func:`int8_matmul` avoids it."""
    return device.type != "cpu" or _CPU_HAS_INT8_GEMM


def exact_float32_length(max_product: int = INT8_MAX_PRODUCT) -> int:
    """The longest contraction whose every partial sum is exact in float32 when no term exceeds
    ``max_product`` in magnitude: 1024 for any int8 operands, 1040 for two INT8 quantizers (±127),
    342392 for two INT4 ones (±7)."""
    return FLOAT32_EXACT // max_product


def int8_matmul(a: torch.Tensor, b: torch.Tensor, max_product: int = INT8_MAX_PRODUCT) -> torch.Tensor:
    """``a @ b`` with int8 operands and an exact int32 result; any strides. ``max_product`` bounds
    ``|a_ik · b_kj|`` (quantizers pass ``qmax_a · qmax_b``).

    ``torch._int_mm`` where :func:`native_int8_matmul`, on a contraction zero-padded to a multiple of 8
    unless known to be one; elsewhere a float32 matmul on the int8 values,
    exact at the speed of the float GEMM: in one piece when the contraction is at most
    :func:`exact_float32_length` long, else in the fewest pieces of equal length within it (padding
    fewer than one column per piece), each exact, summed in int32.
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands, got {a.dtype} and {b.dtype}")
    k = a.shape[1]
    if native_int8_matmul(a.device):
        # cuBLASLt takes only contractions a multiple of 8, and HLA's need not be one.
        if not statically_known_true(k % 8 == 0):
            a, b = F.pad(a, [0, -k % 8]), F.pad(b, [0, 0, 0, -k % 8])
        return torch._int_mm(a, b)
    longest = exact_float32_length(max_product)
    # Under the shape-generic compile of hot_compile.kernels this test is a guard: one kernel per side.
    if k <= longest:
        return torch.mm(a.float(), b.float()).to(torch.int32)
    pieces = (k + longest - 1) // longest
    piece = (k + pieces - 1) // pieces
    a = F.pad(a, [0, pieces * piece - k]).unflatten(1, (pieces, piece)).transpose(0, 1)  # [pieces, M, piece]
    b = F.pad(b, [0, 0, 0, pieces * piece - k]).unflatten(0, (pieces, piece))  # [pieces, piece, N]
    return torch.bmm(a.float(), b.float()).to(torch.int32).sum(0, dtype=torch.int32)


def hq_grad_input(
    grad_output: torch.Tensor,
    weight: torch.Tensor,
    seed: torch.Tensor,
    *,
    grad_bits: int = DEFAULT_GX_BITS,
    weight_bits: int = DEFAULT_GX_BITS,
    per_token: bool = False,
    hadamard: bool = True,
    stochastic_weight: bool = False,
) -> torch.Tensor:
    """grad_input of a linear by Hadamard quantization (HQ).

    ``g W = (g B)(B W) / 16`` with ``B = blockdiag(H16, …)`` along N, so
    ``grad_x ≈ int_mm(q(gB), q(BW)) · s_g · s_w / 16``: ``q(gB)`` stochastic (per-tensor, or per-row
    when ``per_token``), ``q(BW)`` SAWB round-to-nearest, or with ``stochastic_weight`` stochastic at
    the max scale (then ``E[q(BW)] = BW`` and the product is unbiased; SAWB's clip is not).
    Returns ``[..., K]`` in ``grad_output``'s dtype.
    ``hadamard=False`` quantizes ``g`` and ``W`` as they are (plain INT4, the ablation baseline).
    """
    n, k = weight.shape
    g2 = grad_output.reshape(-1, n).float()
    w = weight.float()
    if hadamard:
        g2, w = block_hadamard(g2, 1), block_hadamard(w, 0)
    qg, sg = quantize_stochastic(g2, grad_bits, seed, per_token=per_token, salt=SALT_GRAD_INPUT)
    if stochastic_weight:
        qw, sw = quantize_stochastic(w, weight_bits, seed, salt=SALT_WEIGHT)
    else:
        qw, sw = quantize_sawb(w, weight_bits)
    norm = BLOCK if hadamard else 1
    out = int8_matmul(qg, qw, qmax(grad_bits) * qmax(weight_bits)).to(torch.float32) * (sg * (sw / norm))
    return out.to(grad_output.dtype).reshape(*grad_output.shape[:-1], k)


def _lowpass(x2: torch.Tensor, rank: int, tail: torch.Tensor | None) -> torch.Tensor:
    if tail is None:
        tail = tail_basis(x2.shape[0] % BLOCK, rank, device=x2.device)
    return lowpass(x2.float(), rank, tail)


def compress_activation(
    x: torch.Tensor, tail: torch.Tensor | None = None, *, rank: int = DEFAULT_RANK, bits: int = DEFAULT_GW_BITS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation buffer compression (ABC): ``x → (q(P_L x), s_x)``.

    ``P_L`` (:func:`hot_compile.hadamard.lowpass`) keeps the ``rank`` lowest-sequency Walsh rows of
    each block of 16 tokens, and proportionally fewer of the ``L mod 16`` left over, so the int8 result
    is ``[⌊r·L/16⌋, K]`` at most: ``r/64`` of the bytes of a float32 ``x`` (1/8 at r = 8) at any L.
    ``tail`` is ``tail_basis(L mod 16, rank)``, built here when not given.
    """
    x2 = x.reshape(-1, x.shape[-1])
    return quantize_nearest(_lowpass(x2, rank, tail), bits)


def hla_grad_weight(
    grad_output: torch.Tensor,
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    seed: torch.Tensor,
    tail: torch.Tensor | None = None,
    *,
    rank: int = DEFAULT_RANK,
    bits: int = DEFAULT_GW_BITS,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """grad_weight of a linear by Hadamard low-rank approximation (HLA).

    ``gᵀ x ≈ (P_L g)ᵀ (P_L x) / 16`` (exact at r = 16), so
    ``grad_W ≈ int_mm(q(P_L g)ᵀ, q(P_L x)) · s_g · s_x / 16`` with ``q(P_L g)`` stochastic per-tensor
    and ``(q(P_L x), s_x)`` from :func:`compress_activation` at the same ``rank`` (and ``tail``).
    Returns ``[N, K]``.
    """
    g2 = grad_output.reshape(-1, grad_output.shape[-1])
    qg, sg = quantize_stochastic(_lowpass(g2, rank, tail), bits, seed, salt=SALT_GRAD_WEIGHT)
    out = int8_matmul(qg.t(), x_q, qmax(bits) ** 2).to(torch.float32) * (sg * (x_scale / BLOCK))
    return out.to(out_dtype or grad_output.dtype)
