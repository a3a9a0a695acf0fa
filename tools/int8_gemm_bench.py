"""HOT's integer GEMM with its dequantize, against the float product it replaces, at the products of
the bench models (``tools/bench.py``): each of the shapes below as the rewritten graph runs it.

Interleaved in one process, so that a CPU whose rate moves from one second to the next (a VM sharing
its AMX unit) moves every column alike. Columns, milliseconds (median of ``--repeats``, and the
fastest), output in bf16 as under autocast:

* ``hot``: ``cpu_kernels.matmul_dequantized``, the GEMM HOT's CPU ops run (HOT's own on AMX tiles or
  AVX512-VNNI registers where ``cpu_kernels.fused_gemm()`` names one, else ``torch._int_mm`` in row
  chunks);
* ``int_mm``: the same with ``torch._int_mm`` in row chunks, where the first is HOT's own;
* ``bf16``: ``torch.mm`` on bf16 operands of the same layout, the product Inductor runs under autocast.

    python tools/int8_gemm_bench.py --out benchmarks/int8-gemm-spr
"""

from __future__ import annotations

import functools
import statistics
import unittest.mock

import torch

from hot_compile.harness.bench import interleaved_seconds, machine_info
from hot_compile.harness.bench_report import kernel_bench_parser, machine_line, write_table
from hot_compile.runtime import cpu_kernels, int8_gemm

# (name, M, K, N, layout): the MLP block's and ViT-S's products at 32 × 196(197) tokens; layout of
# (A, B): "rows" row-major, "cols" its transpose in memory (the forward's q(W)ᵀ, HLA's q(P g)ᵀ).
SHAPES = (
    ("MLP fwd fc1", 6272, 768, 3072, ("rows", "cols")),
    ("MLP fwd fc2", 6272, 3072, 768, ("rows", "cols")),
    ("MLP grad_input fc2", 6272, 768, 3072, ("rows", "rows")),
    ("MLP grad_input fc1", 6272, 3072, 768, ("rows", "rows")),
    ("MLP grad_weight fc2", 768, 6272, 3072, ("cols", "rows")),
    ("MLP grad_weight fc1", 3072, 6272, 768, ("cols", "rows")),
    ("ViT qkv fwd", 6304, 384, 1152, ("rows", "cols")),
    ("ViT fc2 grad_input", 6304, 384, 1536, ("rows", "rows")),
    ("ViT fc2 fwd", 6304, 1536, 384, ("rows", "cols")),
    ("ViT fc1 grad_weight", 1536, 6304, 384, ("cols", "rows")),
)


def _operand(rows: int, cols: int, layout: str) -> torch.Tensor:
    if layout == "cols":
        return torch.randint(-127, 128, (cols, rows), dtype=torch.int8).t()
    return torch.randint(-127, 128, (rows, cols), dtype=torch.int8)


def _on_int_mm_chunks(*args) -> torch.Tensor:
    """``matmul_dequantized`` on ``torch._int_mm`` in row chunks, where it would run HOT's own GEMM."""
    with unittest.mock.patch.object(cpu_kernels, "fused_gemm", lambda: ""):
        return cpu_kernels.matmul_dequantized(*args)


def measure(repeats: int) -> list[dict]:
    product = functools.partial(int8_gemm.int8_matmul, a_max=127, b_max=127)
    rows = []
    for name, m, k, n, (a_layout, b_layout) in SHAPES:
        a, b = _operand(m, k, a_layout), _operand(k, n, b_layout)
        af, bf = a.to(torch.bfloat16), b.to(torch.bfloat16)
        row_scale, col_scale = torch.rand(m), torch.rand(n)
        args = (a, b, row_scale, col_scale, 16.0, torch.bfloat16, product)
        calls = {"hot": lambda: cpu_kernels.matmul_dequantized(*args), "bf16": lambda: torch.mm(af, bf)}
        if cpu_kernels.fused_gemm():
            calls["int_mm"] = lambda: _on_int_mm_chunks(*args)
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
    rows = measure(args.repeats)
    engine = cpu_kernels.fused_gemm()
    lines = [
        machine_line(machine_info()),
        "",
        f"`python tools/int8_gemm_bench.py --out {args.out}`; hot = "
        + (f"HOT's GEMM on {engine.upper()}" if engine else "torch._int_mm in row chunks")
        + f", medians (fastest) of {args.repeats} interleaved calls, ms",
        "",
        "| product | M × K × N | hot | " + ("int_mm chunks | " if engine else "") + "bf16 mm | hot / bf16 |",
        "|---|---|---|" + ("---|" if engine else "") + "---|---|",
    ]
    for r in rows:
        cells = [f"{r['hot_ms']:.2f} ({r['hot_min_ms']:.2f})"]
        if engine:
            cells.append(f"{r['int_mm_ms']:.2f} ({r['int_mm_min_ms']:.2f})")
        cells.append(f"{r['bf16_ms']:.2f} ({r['bf16_min_ms']:.2f})")
        lines.append(
            f"| {r['name']} | {r['m']} × {r['k']} × {r['n']} | " + " | ".join(cells) + f" | {r['hot_ms'] / r['bf16_ms']:.2f} |"
        )
    write_table(args.out, "int8_gemm", {"engine": engine, "rows": rows}, lines)


if __name__ == "__main__":
    main()
