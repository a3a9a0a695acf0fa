"""HOT's integer GEMM with its dequantize, against the float product it replaces, at the products of
the bench models (``tools/bench.py``): each of the shapes below as the rewritten graph runs it.

Interleaved in one process, so that a CPU whose rate moves from one second to the next (a VM sharing
its AMX unit) moves every column alike. Columns, milliseconds (median of ``--repeats``, and the
fastest), output in bf16 as under autocast (in float32 on AVX2, where bf16 products are emulated):

* ``hot``: ``cpu_gemm.matmul_dequantized``, the GEMM HOT's CPU ops run (HOT's own on AMX tiles,
  AVX512-VNNI or AVX2 registers where ``cpu_gemm.fused_gemm()`` names one, else ``int8_matmul`` in row
  chunks), on INT8 codes (INT7 on AVX2, the width the engine takes there and the default);
* ``own GEMM, every shape``: on VNNI, HOT's own GEMM at the shapes ``hot`` leaves to ``torch._int_mm``
  too (a contraction over 4× the rows, ``cpu_gemm.VNNI_CONTRACTION_PER_ROW``);
* ``int_mm``: the same with ``int8_matmul`` (``torch._int_mm``, or oneDNN's uint8 × int8 on AVX2) in
  row chunks, where the first is HOT's own;
* ``float``: ``torch.mm`` on bf16 operands of the same layout, the product Inductor runs under
  autocast (float32 on AVX2).

    python tools/int8_gemm_bench.py --out benchmarks/int8-gemm-spr
"""

from __future__ import annotations

import functools
import math
import statistics
import unittest.mock

import torch

from hot_compile.harness.bench import interleaved_seconds, machine_info
from hot_compile.harness.bench_report import kernel_bench_parser, machine_line, write_table
from hot_compile.runtime import cpu_gemm, int8_gemm

# (name, M, K, N, layout): the MLP block's, ViT-S's and MiniLM's products at 32 × 196(197) and 32 × 128
# tokens; layout of (A, B): "rows" row-major, "cols" its transpose in memory (the forward's q(W)ᵀ).
SHAPES = (
    ("MLP fwd fc1", 6272, 768, 3072, ("rows", "cols")),
    ("MLP fwd fc2", 6272, 3072, 768, ("rows", "cols")),
    ("MLP grad_input fc2", 6272, 768, 3072, ("rows", "rows")),
    ("MLP grad_input fc1", 6272, 3072, 768, ("rows", "rows")),
    ("MLP grad_weight fc2", 768, 6272, 3072, ("rows", "rows")),
    ("MLP grad_weight fc1", 3072, 6272, 768, ("rows", "rows")),
    ("ViT qkv fwd", 6304, 384, 1152, ("rows", "cols")),
    ("ViT fc2 grad_input", 6304, 384, 1536, ("rows", "rows")),
    ("ViT fc2 fwd", 6304, 1536, 384, ("rows", "cols")),
    ("ViT fc1 grad_weight", 1536, 6304, 384, ("rows", "rows")),
    ("MiniLM intermediate grad_input", 4096, 384, 1536, ("rows", "rows")),
    ("MiniLM output grad_weight", 384, 4096, 1536, ("rows", "rows")),
)


def _operand(rows: int, cols: int, layout: str, q_max: int) -> torch.Tensor:
    if layout == "cols":
        return torch.randint(-q_max, q_max + 1, (cols, rows), dtype=torch.int8).t()
    return torch.randint(-q_max, q_max + 1, (rows, cols), dtype=torch.int8)


def _patched(name: str, value):
    """``matmul_dequantized`` with ``cpu_gemm.<name>`` set to ``value``."""

    def call(*args, **kwargs) -> torch.Tensor:
        with unittest.mock.patch.object(cpu_gemm, name, value):
            return cpu_gemm.matmul_dequantized(*args, **kwargs)

    return call


def _columns(engine: str) -> dict[str, str]:
    """Column key → heading, beyond ``hot``: where HOT has its own GEMM, ``torch._int_mm`` in row chunks,
    and on VNNI the own GEMM at every shape (``hot`` leaves long contractions of few rows to ``int_mm``)."""
    columns = {"own": "own GEMM, every shape"} if engine == "vnni" else {}
    return columns | ({"int_mm": "int_mm chunks"} if engine else {}) | {"float": f"{_float_dtype(engine)} mm"}


def _float_dtype(engine: str) -> str:
    return "float32" if engine == "avx2" else "bfloat16"


def measure(repeats: int, engine: str) -> list[dict]:
    q_max = 63 if engine == "avx2" else 127
    dtype = getattr(torch, _float_dtype(engine))
    product = functools.partial(int8_gemm.int8_matmul, a_max=q_max, b_max=q_max)
    variants = {"hot": cpu_gemm.matmul_dequantized, "own": _patched("VNNI_CONTRACTION_PER_ROW", math.inf), "int_mm": _patched("fused_gemm", lambda: "")}
    rows = []
    for name, m, k, n, (a_layout, b_layout) in SHAPES:
        a, b = _operand(m, k, a_layout, q_max), _operand(k, n, b_layout, q_max)
        af, bf = a.to(dtype), b.to(dtype)
        row_scale, col_scale = torch.rand(m), torch.rand(n)
        args = (a, b, row_scale, col_scale, 16.0, dtype, product)
        calls = {key: (lambda f=f: f(*args, b_max=q_max)) for key, f in variants.items() if key == "hot" or key in _columns(engine)}
        calls["float"] = lambda: torch.mm(af, bf)
        times = interleaved_seconds(calls, repeats)
        rows.append(
            {"name": name, "m": m, "k": k, "n": n, "layout": [a_layout, b_layout]}
            | {f"{key}_ms": statistics.median(t) * 1e3 for key, t in times.items()}
            | {f"{key}_min_ms": min(t) * 1e3 for key, t in times.items()}
        )
    return rows


def main() -> None:
    parser = kernel_bench_parser(__doc__.split("\n\n")[0], repeats=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = cpu_gemm.fused_gemm()
    rows = measure(args.repeats, engine)
    columns = _columns(engine)
    lines = [
        machine_line(machine_info()),
        "",
        f"`python tools/int8_gemm_bench.py --out {args.out}`; hot = "
        + (f"HOT's GEMM on {engine.upper()}" if engine else "int8_matmul in row chunks")
        + f", medians (fastest) of {args.repeats} interleaved calls, ms",
        "",
        "| product | M × K × N | hot | " + " | ".join(columns.values()) + f" | hot / {_float_dtype(engine)} |",
        "|---|---|---|" + "---|" * len(columns) + "---|",
    ]
    for r in rows:
        cells = [f"{r[key + '_ms']:.2f} ({r[key + '_min_ms']:.2f})" for key in ("hot", *columns)]
        lines.append(
            f"| {r['name']} | {r['m']} × {r['k']} × {r['n']} | " + " | ".join(cells) + f" | {r['hot_ms'] / r['float_ms']:.2f} |"
        )
    write_table(args.out, "int8_gemm", {"engine": engine, "rows": rows}, lines)


if __name__ == "__main__":
    main()
