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

DEFAULT_GX_BITS = 8
DEFAULT_GW_BITS = 8
DEFAULT_FORWARD_BITS = 8
# The full Walsh basis: no low-rank cut unless calibration shows neighbouring tokens are alike.
DEFAULT_RANK = 16


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
# The largest magnitude of an int8 value: -128.
INT8_MAX = 128
# oneDNN's uint8 × int8 GEMM without VNNI adds adjacent products in saturating int16 (vpmaddubsw).
INT16_MAX = 2**15 - 1
# Read once: Dynamo does not trace into torch.cpu's feature queries.
_CPU_HAS_INT8_GEMM = torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()
_CPU_HAS_ONEDNN_U8S8 = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() in (
    "AVX2",
    "AVX512",
)


def int8_gemm_kind(device: torch.device) -> str:
    """The integer GEMM :func:`int8_matmul` has on ``device``:

    * ``"int_mm"``: ``torch._int_mm`` in hardware, on GPUs and on CPUs with AVX512-VNNI or AMX;
    * ``"u8s8"``: other x86 CPUs with oneDNN (AVX2). There ``torch._int_mm`` runs about 30× slower than
      an fp32 matmul, but oneDNN's uint8 × int8 linear runs 1.5–2× faster than one, and is exact for
      operands narrow enough that no int16 pair sum saturates (INT4 levels; :func:`u8s8_exact`);
    * ``"float"``: neither, a float32 GEMM on the int8 values.
    """
    if device.type != "cpu" or _CPU_HAS_INT8_GEMM:
        return "int_mm"
    return "u8s8" if _CPU_HAS_ONEDNN_U8S8 else "float"


def u8s8_exact(a_max: int, b_max: int) -> bool:
    """Whether oneDNN's uint8 × int8 product is exact for ``|a| ≤ a_max``, ``|b| ≤ b_max``: ``a`` shifted
    to ``a + a_max`` (at most ``2·a_max``), two products summed in int16 must stay within 32767."""
    return 2 * min(2 * a_max, 255) * b_max <= INT16_MAX


def u8s8_operand(a: torch.Tensor, a_max: int) -> tuple[torch.Tensor, int]:
    """int8 ``a`` with ``|a| ≤ a_max`` as :func:`u8s8_linear` takes it: ``(a + zero_point)`` in uint8,
    and the zero point."""
    zero_point = min(a_max, INT8_MAX)
    # Through int32: Inductor's C++ backend vectorizes int32 → uint8 and left the int16 form to
    # scalar code (HQ at [6272, 3072] took 284 ms instead of 191).
    return (a.to(torch.int32) + zero_point).to(torch.uint8), zero_point


@torch.library.custom_op("hot_compile::u8s8_linear", mutates_args=())
def u8s8_linear(a: torch.Tensor, zero_point: int, weight: torch.Tensor) -> torch.Tensor:
    """``(a − zero_point) @ weightᵀ`` for uint8 ``a: [M, K]`` and int8 ``weight: [N, K]``, as float32, by
    oneDNN's quantized linear: int32 accumulation, each value then exact below 2**24. Opaque to the
    compiles that call it, which hand it their operands as oneDNN takes them."""
    n = weight.shape[0]
    packed = torch.ops.onednn.qlinear_prepack(weight.contiguous(), None)
    return torch.ops.onednn.qlinear_pointwise.tensor(
        a.contiguous(),
        torch.ones((), device=a.device),
        torch.tensor(zero_point, device=a.device),
        packed,
        torch.ones(n, device=a.device),
        torch.zeros(n, dtype=torch.int64, device=a.device),
        None,
        1.0,
        0,
        torch.float32,
        "none",
        [],
        "",
    )


@u8s8_linear.register_fake
def _u8s8_linear_fake(a: torch.Tensor, zero_point: int, weight: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], weight.shape[0], dtype=torch.float32)


def exact_float32_length(max_product: int = INT8_MAX * INT8_MAX) -> int:
    """The longest contraction whose every partial sum is exact in float32 when no term exceeds
    ``max_product`` in magnitude: 1024 for any int8 operands, 1040 for two INT8 quantizers (±127),
    342392 for two INT4 ones (±7)."""
    return FLOAT32_EXACT // max_product


def int8_matmul(a: torch.Tensor, b: torch.Tensor, a_max: int = INT8_MAX, b_max: int = INT8_MAX) -> torch.Tensor:
    """``a @ b`` with int8 operands and an exact int32 result; any strides. ``a_max`` and ``b_max``
    bound the operands' magnitudes (quantizers pass their ``qmax``).

    By :func:`int8_gemm_kind`: ``torch._int_mm``, on a contraction zero-padded to a multiple of 8
    unless known to be one; oneDNN's uint8 × int8 linear where :func:`u8s8_exact` and the contraction
    is at most :func:`exact_float32_length` long; elsewhere a float32 matmul on the int8 values, exact
    at the speed of the float GEMM: in one piece when the contraction is at most
    :func:`exact_float32_length` long, else in the fewest pieces of equal length within it (padding
    fewer than one column per piece), each exact, summed in int32.
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands, got {a.dtype} and {b.dtype}")
    k = a.shape[1]
    kind = int8_gemm_kind(a.device)
    if kind == "int_mm":
        # cuBLASLt takes only contractions a multiple of 8, and HLA's need not be one.
        if not statically_known_true(k % 8 == 0):
            a, b = F.pad(a, [0, -k % 8]), F.pad(b, [0, 0, 0, -k % 8])
        return torch._int_mm(a, b)
    longest = exact_float32_length(a_max * b_max)
    # Under the shape-generic compile of hot_compile.kernels the length tests are guards: one kernel
    # per side.
    if kind == "u8s8" and u8s8_exact(a_max, b_max) and k <= longest:
        shifted, zero_point = u8s8_operand(a, a_max)
        return u8s8_linear(shifted, zero_point, b.t().contiguous()).to(torch.int32)
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

    ``P_L`` (:func:`hot_compile.hadamard.lowpass`) keeps the ``rank`` lowest-sequency Walsh rows of
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
