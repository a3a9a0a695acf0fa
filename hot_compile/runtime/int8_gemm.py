"""Integer matrix products with an exact int32 result on every device: ``torch._int_mm`` where the
hardware has an int8 GEMM, oneDNN's uint8 × int8 linear on AVX2 CPUs, else a float32 GEMM on the int8
values in pieces short enough to stay exact."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

# float32 holds every integer up to 2**24 exactly.
FLOAT32_EXACT = 2**24
# The largest magnitude of an int8 value: -128.
INT8_MAX = 128
# oneDNN's uint8 × int8 GEMM without VNNI adds adjacent products in saturating int16 (vpmaddubsw).
INT16_MAX = 2**15 - 1
# Read once: Dynamo does not trace into torch.cpu's feature queries.
CPU_INT8_INSTRUCTIONS = torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()


def int_mm_exact() -> bool:
    """Whether ``torch._int_mm`` sums int8 products exactly on this CPU. The CPU's features do not
    settle it: oneDNN limited to an ISA without VNNI (``ONEDNN_MAX_CPU_ISA=AVX2`` or ``AVX512_CORE``)
    runs its uint8 × int8 kernel, whose int16 pair sums saturate at full-range operands."""
    a = torch.full((32, 64), 127, dtype=torch.int8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # importing the package starts no OpenMP workers
    try:
        return bool((torch._int_mm(a, a.t().contiguous()) == 64 * 127 * 127).all())
    finally:
        torch.set_num_threads(threads)


_CPU_HAS_INT8_GEMM = CPU_INT8_INSTRUCTIONS and int_mm_exact()
if CPU_INT8_INSTRUCTIONS and not _CPU_HAS_INT8_GEMM:
    warnings.warn(
        "hot_compile: torch._int_mm does not sum int8 products exactly in this process (oneDNN is limited to an ISA "
        "without VNNI or AMX, e.g. by ONEDNN_MAX_CPU_ISA); HOT's integer products run on its own GEMM instead",
        RuntimeWarning,
    )
_CPU_HAS_ONEDNN_U8S8 = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() in (
    "AVX2",
    "AVX512",
)


def int8_gemm_kind(device: torch.device) -> str:
    """The integer GEMM :func:`int8_matmul` has on ``device``:

    * ``"int_mm"``: ``torch._int_mm`` in hardware, on GPUs and on CPUs with AVX512-VNNI or AMX where
      it is exact (:func:`int_mm_exact`);
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


def gemm_path(device: torch.device, k, a_max: int = INT8_MAX, b_max: int = INT8_MAX) -> str:
    """Which product :func:`int8_matmul` runs for a contraction of ``k`` on ``device``, with operands
    bounded by ``a_max`` and ``b_max``: ``"int_mm"`` (``torch._int_mm``), ``"u8s8"`` (oneDNN's uint8 ×
    int8 linear), ``"float32"`` (one exact float32 GEMM on the int8 values) or ``"float32 pieces"``
    (several, summed in int32)."""
    kind = int8_gemm_kind(device)
    if kind == "int_mm":
        return "int_mm"
    longest = exact_float32_length(a_max * b_max)
    # Under the shape-generic compile of hot_compile.runtime.ops the length tests are guards: one
    # kernel per side.
    if kind == "u8s8" and u8s8_exact(a_max, b_max) and k <= longest:
        return "u8s8"
    return "float32" if k <= longest else "float32 pieces"


def int8_matmul(a: torch.Tensor, b: torch.Tensor, a_max: int = INT8_MAX, b_max: int = INT8_MAX) -> torch.Tensor:
    """``a @ b`` with int8 operands and an exact int32 result; any strides. ``a_max`` and ``b_max``
    bound the operands' magnitudes (quantizers pass their ``qmax``).

    By :func:`gemm_path`: ``torch._int_mm``, on a contraction zero-padded to a multiple of 8 unless
    known to be one; oneDNN's uint8 × int8 linear where :func:`u8s8_exact` and the contraction is at
    most :func:`exact_float32_length` long; elsewhere a float32 matmul on the int8 values, exact at the
    speed of the float GEMM: in one piece when the contraction is at most :func:`exact_float32_length`
    long, else in the fewest pieces of equal length within it (padding fewer than one column per
    piece), each exact, summed in int32.
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands, got {a.dtype} and {b.dtype}")
    k = a.shape[1]
    path = gemm_path(a.device, k, a_max, b_max)
    if path == "int_mm":
        # cuBLASLt takes only contractions a multiple of 8, and HLA's need not be one.
        if not statically_known_true(k % 8 == 0):
            a, b = F.pad(a, [0, -k % 8]), F.pad(b, [0, 0, 0, -k % 8])
        return torch._int_mm(a, b)
    if path == "u8s8":
        shifted, zero_point = u8s8_operand(a, a_max)
        return u8s8_linear(shifted, zero_point, b.t().contiguous()).to(torch.int32)
    if path == "float32":
        return torch.mm(a.float(), b.float()).to(torch.int32)
    longest = exact_float32_length(a_max * b_max)
    pieces = (k + longest - 1) // longest
    piece = (k + pieces - 1) // pieces
    a = F.pad(a, [0, pieces * piece - k]).unflatten(1, (pieces, piece)).transpose(0, 1)  # [pieces, M, piece]
    b = F.pad(b, [0, 0, 0, pieces * piece - k]).unflatten(0, (pieces, piece))  # [pieces, piece, N]
    return torch.bmm(a.float(), b.float()).to(torch.int32).sum(0, dtype=torch.int32)
