"""HOT's transforms and quantizers on the CPU as fused native loops (``cpu_vectors.cpp``, ``cpu_primitives.cpp``,
``cpu_kernels.cpp``, ``cpu_encode.cpp``, ``cpu_attention.cpp``, ``cpu_attention_native.cpp``, ``cpu_gemm.cpp``, ``cpu_gemm_engines.cpp``).

Compiled by Inductor, the aten composites of :mod:`hot_compile.runtime.aten_impl` spent most of a CPU backward
outside the integer GEMM (the MLP block under bf16 autocast, Zen 4: 300 ms of 480, against 162 ms in
``torch._int_mm``): each Hadamard transform was an extern matmul into a fresh float32 buffer, each
per-slice scale a second pass over it, and each dequantize a pass over a fresh int32 product. Here:

* :func:`quantize_rows` transforms each row in blocks of 16, takes its scale and quantizes it in one
  read of the operand (HQ's ``g``, one scale per token);
* :func:`quantize_columns` applies a ``[r, 16]`` basis to each block of 16 rows (the Hadamard
  matrix for HQ's weight, the low-pass Walsh rows for HLA and ABC) in two reads: the per-column
  statistics, then the quantization, recomputing the transform rather than storing it;
* :func:`hot_compile.runtime.cpu_gemm.matmul_dequantized` runs the integer GEMM and scales its int32
  sums into the output dtype (HOT's own GEMM, ``cpu_gemm*.cpp``, or ``int8_matmul`` in row chunks);
* :func:`encode_rows` and :func:`encode_derivative` code a saved activation (``compress_saved``) one
  row at a time, in two reads of the row: its range, then its codes.

The numerics are those of :mod:`hot_compile.runtime.aten_impl` (same transforms, scales, hash noise and
rounding; only the order of float additions differs), as ``tests/test_cpu_kernels.py`` checks. The
library is built by Inductor's C++ toolchain, once per machine: ``make install`` builds it
(``hot-compile build-kernels``), else the first use does, and a copy is kept in HOT's own cache
(:func:`~hot_compile.runtime.devices.cache_root`), so that a fresh Inductor cache does not build it again.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time

import torch

from .aten_impl import DERIVATIVES, GIVEN, check_derivative, derivative_of
from .devices import CPU_CLASSES, cache_root, cpu_class, cpu_identity
from .quant import guard_scale, qmax

# One translation unit, in this order.
_SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ("cpu_vectors.cpp", "cpu_primitives.cpp", "cpu_kernels.cpp", "cpu_encode.cpp", "cpu_attention.cpp", "cpu_attention_native.cpp", "cpu_gemm.cpp", "cpu_gemm_engines.cpp"))
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# aten_impl.encode_derivative's functions, as cpu_encode.cpp numbers them.
_DERIVATIVES = {name: number for number, name in enumerate((GIVEN, *DERIVATIVES))}

_P, _I, _F, _U = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_uint32
_SIGNATURES = {
    "hot_rows_quantize": (_P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _U, _P, _I, _P, _P, _P),
    "hot_cols_stats": (_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _P, _P),
    "hot_cols_quantize": (_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _I, _U, _P, _I, _I),
    "hot_dequantize": (_P, _I, _I, _I, _P, _I, _P, _I, _F, _P, _P, _I),
    "hot_rows_encode": (_P, _I, _P, _P, _P, _I, _I, _P, _P),
    "hot_derivative_encode": (_P, _I, _I, _I, _I, _U, _P, _P, _P),
    "hot_derivative_values": (_P, _I, _I, _I, _P),
    "hot_attention_probabilities": (_P, _P, _I, _I, _P, _P),
    "hot_attention_row_dots": (_P, _P, _I, _I, _I, _I, _I, _P, _P),
    "hot_attention_backward_compiled": (),
    "hot_attention_backward": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _F, _P, _P, _P),
    "hot_gemm_engines": (),
    "hot_matmul_dequantize": (_P, _I, _I, _I, _I, _P, _I, _I, _I, _P, _I, _P, _I, _F, _P, _P, _I, _I),
}
_RESULTS = {"hot_gemm_engines": ctypes.c_int64, "hot_attention_backward_compiled": ctypes.c_int64}

# Seconds callers have waited for the library: the part of its build that did not overlap anything.
build_seconds = 0.0
_build: concurrent.futures.Future | None = None
_build_lock = threading.Lock()


def library_path() -> pathlib.Path:
    """Where this machine's build of the library is kept: named by its sources, the machine (CPU model,
    core count, torch version), as Inductor compiles for the host's vector ISA, and the CPU class built for."""
    digest = hashlib.sha256(f"{cpu_identity()}|{cpu_class()}".encode())
    for source in _SOURCES:
        digest.update(source.read_bytes())
    return cache_root() / f"cpu_kernels_{digest.hexdigest()[:24]}.so"


def _keep(built: str, path: pathlib.Path) -> None:
    """Copy the library Inductor built to ``path`` (atomically: a concurrent loader sees all or nothing);
    a cache that cannot be written only costs the next process a build."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so.part", delete=False) as part:
            shutil.copyfile(built, part.name)
        os.replace(part.name, path)
    except OSError:
        pass


def compile_sources(sources: list[str]) -> ctypes.CDLL:
    """The library built from ``sources`` (the texts of ``_SOURCES``, in order) by Inductor's C++
    toolchain, with the flags and vector ISA of its own CPU kernels, unbound."""
    from torch._inductor.codecache import CppCodeCache

    return CppCodeCache.load("\n".join(sources), device_type="cpu")


def compile_for_class(sources: list[str], name: str, folder: pathlib.Path) -> ctypes.CDLL:
    """The library built from ``sources`` in ``folder`` with Inductor's command for its C++ kernels, as
    :func:`compile_sources` builds it, but for the CPU class ``name`` of
    :data:`~hot_compile.runtime.devices.CPU_CLASSES`: its ``-march`` for ``-march=native`` and its
    vector ISA; unbound."""
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import VecAVX2, invalid_vec_isa

    source = folder / f"hot_cpu_kernels_{name}.cpp"
    source.write_text("\n".join(sources))
    options = CppTorchDeviceOptions(vec_isa=VecAVX2() if name == "avx2" else invalid_vec_isa, device_type="cpu", extra_flags=())
    command = CppBuilder(name=source.stem, sources=str(source), BuildOption=options, output_dir=str(folder)).get_command_line()
    if "-march=native" not in command:
        raise RuntimeError(f"Inductor's C++ command has no -march=native to build the {name} class's library for: {command}")
    done = subprocess.run(command.replace("-march=native", f"-march={CPU_CLASSES[name][0]}"), shell=True, cwd=folder, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"building HOT's CPU library for the {name} class failed:\n{done.stderr}")
    return ctypes.CDLL(str(folder / f"{source.stem}.so"))


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """``library`` with the argument and result types of each exported kernel set."""
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(library, name)
        fn.argtypes, fn.restype = argtypes, _RESULTS.get(name)
    return library


def compile_library(sources: list[str], keep: pathlib.Path | None = None) -> ctypes.CDLL:
    """The library built from ``sources`` for the CPU class HOT runs (:func:`~hot_compile.runtime.devices.cpu_class`),
    unbound; a copy kept at ``keep``, where given."""
    if cpu_class() == "native":
        library = compile_sources(sources)
        if keep is not None:
            _keep(library._name, keep)
        return library
    with tempfile.TemporaryDirectory() as folder:
        library = compile_for_class(sources, cpu_class(), pathlib.Path(folder))
        if keep is not None:
            _keep(library._name, keep)
        return library


def _load() -> ctypes.CDLL:
    path = library_path()
    try:
        library = ctypes.CDLL(str(path))
    except OSError:
        library = compile_library([p.read_text() for p in _SOURCES], keep=path)
    return bind(library)


def build() -> pathlib.Path:
    """Build the library now, if this machine has no build of it yet; returns where it is kept."""
    library()
    return library_path()


def prepare() -> None:
    """Start loading the library (building it on a machine's first use, about 2 s) on a worker thread,
    so that the compiler runs while the rest of a model compiles. The graph pass calls this when it
    inserts a CPU op; the first call of a kernel waits for it."""
    global _build
    with _build_lock:
        if _build is None:
            _build = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hot-cpu-kernels").submit(_load)


def library() -> ctypes.CDLL:
    global build_seconds
    prepare()
    if _build.done():
        return _build.result()
    start = time.perf_counter()
    library = _build.result()
    build_seconds += time.perf_counter() - start
    return library


def dtype_code(t: torch.Tensor) -> int:
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise TypeError(f"HOT's CPU kernels take float32, bfloat16 or float16 tensors, got {t.dtype}") from None


def scale_arg(scale: torch.Tensor | None) -> tuple[int | None, int]:
    """A float32 scale's pointer and the stride to step it by (0 for one scale)."""
    if scale is None:
        return None, 0
    return scale.data_ptr(), 0 if scale.numel() == 1 else 1


def quantize_rows(
    x: torch.Tensor,
    bits: int,
    *,
    width: int,
    hadamard: bool,
    per_row: bool,
    stochastic: bool = True,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [L, n]`` (any strides) zero-padded to ``width`` columns, each block of 16 columns times the
    Hadamard matrix when ``hadamard``, quantized with one scale per row (``[L, 1]``) or per tensor
    (0-d): int8 ``[L, width]``. Noise index: the flat index in ``[L, width]``."""
    lib, code, qm = library(), dtype_code(x), qmax(bits)
    rows, n = x.shape
    q = torch.empty(rows, width, dtype=torch.int8)
    args = (x.data_ptr(), code, rows, n, x.stride(0), x.stride(1), width, int(hadamard), qm, int(stochastic), offset)
    if per_row:
        scale = torch.empty(rows, 1)
        lib.hot_rows_quantize(*args, None, 0, q.data_ptr(), scale.data_ptr(), None)
        return q, scale
    amax = torch.empty(rows)
    lib.hot_rows_quantize(*args, None, 0, None, None, amax.data_ptr())
    scale = guard_scale(amax.amax() / qm)
    lib.hot_rows_quantize(*args, scale.data_ptr(), 0, q.data_ptr(), None, None)
    return q, scale


def pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def column_amax(x: torch.Tensor, basis: torch.Tensor, tail: torch.Tensor | None, out_rows: int) -> torch.Tensor:
    """``max|y|`` per column of the transformed ``x`` (see :func:`quantize_columns`)."""
    return _column_statistics(x, basis, tail, out_rows, moments=False)[0]


def column_moments(
    x: torch.Tensor, basis: torch.Tensor, tail: torch.Tensor | None, out_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``max|y|``, ``Σ|y|`` and ``Σy²`` per column of the transformed ``x`` (see :func:`quantize_columns`)."""
    return _column_statistics(x, basis, tail, out_rows, moments=True)


def _column_statistics(x, basis, tail, out_rows, *, moments):
    lib, code = library(), dtype_code(x)
    n, k = x.shape
    amax = torch.empty(k)
    abs_sum, sq_sum = (torch.empty(k), torch.empty(k)) if moments else (None, None)
    lib.hot_cols_stats(
        x.data_ptr(), code, n, k, x.stride(0), x.stride(1), basis.data_ptr(), pointer(tail),
        basis.shape[0], out_rows, amax.data_ptr(), pointer(abs_sum), pointer(sq_sum),
    )  # fmt: skip
    return amax, abs_sum, sq_sum


def quantize_columns(
    x: torch.Tensor,
    basis: torch.Tensor,
    tail: torch.Tensor | None,
    out_rows: int,
    bits: int,
    scale: torch.Tensor,
    *,
    stochastic: bool,
    offset: int = 0,
    column_major: bool = False,
) -> torch.Tensor:
    """``x: [n, k]`` (any strides) transformed along its rows and quantized: int8 ``[out_rows, k]``, stored
    column-major where ``column_major`` (for a product that reads it transposed: HLA's ``q(P g)ᵀ``, which
    HOT's GEMM then packs without transposing it).

    Whole blocks of 16 rows give ``basis @ block`` (``basis``: float32 ``[r, 16]``; by butterflies when
    its rows are rows of the Hadamard matrix); the ``n mod 16``
    rows after them, zero-padded to 16, give ``tail @ rest`` (``tail`` ``None``: dropped); the first
    ``out_rows`` rows of the result are kept. ``scale`` (float32, ``[k]`` or one value) divides each
    column before rounding, stochastically (noise index: the flat index in ``[out_rows, k]``) or to
    nearest."""
    lib, code = library(), dtype_code(x)
    n, k = x.shape
    q = torch.empty(k, out_rows, dtype=torch.int8).t() if column_major else torch.empty(out_rows, k, dtype=torch.int8)
    scale_ptr, scale_stride = scale_arg(scale)
    lib.hot_cols_quantize(
        x.data_ptr(), code, n, k, x.stride(0), x.stride(1), basis.data_ptr(), pointer(tail),
        basis.shape[0], out_rows, scale_ptr, scale_stride,
        qmax(bits), int(stochastic), offset, q.data_ptr(), q.stride(0), q.stride(1),
    )  # fmt: skip
    return q


def _rows_of(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` in row-major order, and its rows and columns along the last dimension."""
    cols = x.shape[-1] if x.dim() else 1
    return x.contiguous(), x.numel() // max(cols, 1), cols


def _row_groups(x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """``x``'s rows along its last dimension as three leading dimensions ``(size, stride in x, stride
    in rows of x's order)``, by descending stride in ``x``. A view of rows whole in memory (a head's
    query inside a fused qkv output) stays a view; other layouts become a contiguous copy."""
    if x.dim() and (x.stride(-1) == 1 or x.shape[-1] == 1):
        folded: list[list[int]] = []  # [size, stride, rows per step], outermost first
        rows = 1
        for size, stride in reversed(list(zip(x.shape[:-1], x.stride()[:-1]))):
            if size == 1:
                continue
            if folded and stride == folded[0][1] * folded[0][0]:
                folded[0][0] *= size
            else:
                folded.insert(0, [size, stride, rows])
            rows *= size
        if len(folded) <= 3:
            dims = sorted(folded, key=lambda d: -d[1]) + [[1, 0, 0]] * (3 - len(folded))
            return x, [tuple(d) for d in dims]
    x, rows, cols = _rows_of(x)
    return x, [(rows, cols, 1), (1, 0, 0), (1, 0, 0)]


def encode_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hot_compile.runtime.aten_impl.encode_rows`: ``x: [..., C]`` as int8 levels ``[..., C]``
    (round half to even) of one float32 scale a row, ``max|row| / qmax`` (``[..., 1]``)."""
    lib, code = library(), dtype_code(x)
    x, dims = _row_groups(x)
    cols = x.shape[-1] if x.dim() else 1
    q = torch.empty(x.shape, dtype=torch.int8)
    scale = torch.empty(*x.shape[:-1], 1)
    if x.numel():
        size, stride, row = ((ctypes.c_int64 * 3)(*column) for column in zip(*dims))
        lib.hot_rows_encode(x.data_ptr(), code, size, stride, row, cols, qmax(bits), q.data_ptr(), scale.data_ptr())
    return q, scale


def derivative(x: torch.Tensor, function: str) -> torch.Tensor:
    """The derivative ``function`` (an :data:`~hot_compile.runtime.aten_impl.DERIVATIVES` name) of
    ``x``, in float32, as :func:`encode_derivative` evaluates it before coding it."""
    derivative_of(function)
    lib, code = library(), dtype_code(x)
    x = x.contiguous()
    out = torch.empty(x.shape)
    lib.hot_derivative_values(x.data_ptr(), code, _DERIVATIVES[function], x.numel(), out.data_ptr())
    return out


def encode_derivative(
    x: torch.Tensor, offset: int, function: str = GIVEN, bits: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hot_compile.runtime.aten_impl.encode_derivative` at 4 bits (``bits``, checked): the derivative ``function``
    of ``x: [..., C]`` (``C`` even), or ``x`` itself for ``GIVEN``, as two codes a byte ``[..., C/2]``
    (uint8), with the rows' ``lo`` and ``step`` (``[..., 1]``, float32); ``offset``: the noise's
    :func:`~hot_compile.runtime.quant.noise_offset`. A derivative is computed a row at a time
    (:func:`derivative`), in float32, within 3·10⁻⁷ of the exact one."""
    check_derivative(bits, function)
    lib, code = library(), dtype_code(x)
    x, rows, cols = _rows_of(x)
    if cols % 2:
        raise ValueError(f"the derivative code packs two values a byte along the last dimension, of odd size {cols}")
    packed = torch.empty(*x.shape[:-1], cols // 2, dtype=torch.uint8)
    lo, step = torch.empty(*x.shape[:-1], 1), torch.empty(*x.shape[:-1], 1)
    if x.numel():
        lib.hot_derivative_encode(x.data_ptr(), code, _DERIVATIVES[function], rows, cols, offset, packed.data_ptr(), lo.data_ptr(), step.data_ptr())
    return packed, lo, step
