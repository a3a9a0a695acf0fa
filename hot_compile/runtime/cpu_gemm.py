"""HOT's own integer GEMM on the CPU (``cpu_gemm.cpp``, ``cpu_gemm_engines.cpp`` in the library of
:mod:`hot_compile.runtime.cpu_kernels`): the engine each product runs, and the product scaled into its
output dtype as it leaves the engine, so that no product-sized int32 buffer is ever allocated. Where no
engine runs a product, :func:`~hot_compile.runtime.int8_gemm.int8_matmul` does, in row chunks."""

from __future__ import annotations

import functools

import torch

from . import cpu_kernels, int8_gemm

# Rows of one integer GEMM chunk: its int32 product stays within a few MiB that the allocator reuses.
CHUNK_BYTES = 4 << 20
MIN_CHUNK_ROWS = 256
# The engines of cpu_gemm.cpp, as it numbers them.
_GEMM_ENGINES = {"vnni": 1, "amx": 2, "avx2": 4}
# The widest |b| the AVX2 engine sums exactly: it adds pairs of products in int16 (cpu_gemm_engines.cpp).
AVX2_B_MAX = 64

# HOT's VNNI GEMM packs B (K × N) at each call and saves the int32 product's round trip (M × N,
# written then read). oneDNN's gemm behind torch._int_mm packs B faster, so where the product is short
# and the contraction long (HLA's [384, 4096] × [4096, 1536] in MiniLM: 1.15× its time on Zen 4) it
# wins. The fused GEMM runs where K ≤ 4·M, and everywhere where torch._int_mm is not exact
# (int8_gemm.int_mm_exact); the bench models' other products near that line tie.
VNNI_CONTRACTION_PER_ROW = 4


@functools.cache
def fused_gemm() -> str:
    """The engine of HOT's own integer GEMM (``cpu_gemm.cpp``): ``"amx"`` where the library was built
    with AMX and the OS lets this process use it, else ``"vnni"`` or ``"avx2"`` as it was built (AVX2's
    within :func:`gemm_engine`'s bound), else ``""``: :func:`matmul_dequantized`'s ``matmul`` in row chunks."""
    engines = cpu_kernels.library().hot_gemm_engines()
    if engines & _GEMM_ENGINES["amx"] and torch.cpu._init_amx():
        return "amx"
    return next((name for name in ("vnni", "avx2") if engines & _GEMM_ENGINES[name]), "")


def gemm_engine(b_max: int = int8_gemm.INT8_MAX) -> str:
    """:func:`fused_gemm`'s engine for a product whose ``|b| ≤ b_max``: none where AVX2's and ``b_max > AVX2_B_MAX``."""
    engine = fused_gemm()
    return "" if engine == "avx2" and b_max > AVX2_B_MAX else engine


def matmul_dequantized(
    a: torch.Tensor,
    b: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    divisor: float,
    out_dtype: torch.dtype,
    matmul,
    bias: torch.Tensor | None = None,
    *,
    b_max: int = int8_gemm.INT8_MAX,
) -> torch.Tensor:
    """``matmul(a, b) · row_scale · col_scale / divisor (+ bias)`` in ``out_dtype``: ``a: [M, K]``,
    ``b: [K, N]`` int8 (any strides), ``matmul`` their exact int32 product
    (:func:`hot_compile.runtime.int8_gemm.int8_matmul`; where :func:`fused_gemm`, HOT's own GEMM computes
    the same exact sums instead and ``matmul`` is not called), ``row_scale`` ``[M]``-sized or one value,
    ``col_scale`` ``[N]``-sized or one value (float32, contiguous), ``bias`` ``[N]`` of any float dtype,
    ``b_max`` a bound of ``|b|`` (:func:`gemm_engine`)."""
    lib = cpu_kernels.library()
    m, n = a.shape[0], b.shape[1]
    out = torch.empty(m, n, dtype=out_dtype)
    code = cpu_kernels.dtype_code(out)
    row_ptr, row_stride = cpu_kernels.scale_arg(row_scale)
    col_ptr, col_stride = cpu_kernels.scale_arg(col_scale)
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    engine = gemm_engine(b_max)
    short = a.shape[1] <= VNNI_CONTRACTION_PER_ROW * m
    if engine in ("amx", "avx2") or (engine == "vnni" and (short or int8_gemm.int8_gemm_kind(a.device) != "int_mm")):
        if m and n:
            lib.hot_matmul_dequantize(
                a.data_ptr(), m, a.shape[1], a.stride(0), a.stride(1), b.data_ptr(), n, b.stride(0), b.stride(1),
                row_ptr, row_stride, col_ptr, col_stride, divisor, cpu_kernels.pointer(bias), out.data_ptr(), code,
                _GEMM_ENGINES[engine],
            )  # fmt: skip
        return out
    rows = max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * max(n, 1)))
    for start in range(0, m, rows):
        stop = min(m, start + rows)
        acc = matmul(a[start:stop], b)
        offset_ptr = row_ptr + 4 * start * row_stride
        lib.hot_dequantize(
            acc.data_ptr(), stop - start, n, acc.stride(0), offset_ptr, row_stride, col_ptr, col_stride,
            divisor, cpu_kernels.pointer(bias), out[start:stop].data_ptr(), code,
        )  # fmt: skip
    return out
