"""HOT's CPU quantizers alone, at the operands of the bench models (``tools/bench.py``): the values
per second of each kernel of HOT's C++ library that a rewritten step runs besides its GEMM.

* ``rows SR``: ``cpu_kernels.quantize_rows`` with the block Hadamard transform and stochastic rounding,
  one scale per row: HQ's gradient and the integer forward's activation;
* ``rows RN``: the same rounding to nearest, for what the noise costs;
* ``columns SR``: HLA's ``q(P g)``, the transform along the tokens (rank 16), its column maxima, then
  its stochastic codes stored column-major (``ops._quantize_by_columns``, as HLA runs it);
* ``columns RN``: ABC's compressed activation, the same rounded to nearest (``compress_activation``);
* ``row code``: ``cpu_kernels.encode_rows``, the int8 code of a saved activation;
* ``derivative code``: ``cpu_kernels.encode_derivative``, the 4-bit stochastic code of a derivative
  the forward computed;
* ``GELU' code``: the same code of GELU's derivative, which the encoder computes from the operand.

With ``--against REV`` each kernel also runs on the library built from the C++ sources of git
revision ``REV``, interleaved call by call with this tree's, so that a CPU whose rate moves from one
second to the next (a VM sharing its cores) moves both alike. ``REV``'s library must export this
tree's C signatures (``cpu_kernels._SIGNATURES``).

    python tools/quantizer_bench.py --out benchmarks/quantizers-spr --against HEAD~1
"""

from __future__ import annotations

import pathlib
import statistics
import subprocess
import unittest.mock

import torch

from hot_compile.harness.bench import interleaved_seconds, machine_info
from hot_compile.harness.bench_report import kernel_bench_parser, machine_line, write_table
from hot_compile.runtime import cpu_kernels, ops
from hot_compile.runtime.hadamard import BLOCK, walsh_basis

# (operand, rows, columns): ViT-S's at 32 × 197 tokens and the MLP block's at 32 × 196.
SHAPES = (("ViT fc1 output", 6304, 1536), ("ViT block input", 6304, 384), ("MLP fc1 output", 6272, 3072))


def _kernels(x: torch.Tensor) -> dict:
    width, basis = x.shape[1], walsh_basis(BLOCK)
    return {
        "rows SR": lambda: cpu_kernels.quantize_rows(x, 8, width=width, hadamard=True, per_row=True, stochastic=True, offset=1),
        "rows RN": lambda: cpu_kernels.quantize_rows(x, 8, width=width, hadamard=True, per_row=True, stochastic=False),
        "columns SR": lambda: ops._quantize_by_columns(x, basis, None, x.shape[0], 8, per_column=True, stochastic=True, offset=1, column_major=True),
        "columns RN": lambda: ops.compress_activation(x, BLOCK, 8, True),
        "row code": lambda: cpu_kernels.encode_rows(x, 8),
        "derivative code": lambda: cpu_kernels.encode_derivative(x, 1),
        "GELU' code": lambda: cpu_kernels.encode_derivative(x, 1, "gelu"),
    }


def library_at(revision: str):
    """HOT's C++ library built from the sources of git revision ``revision``, as this tree's is built:
    the files of this tree's translation unit that the revision has, in their order."""
    root = pathlib.Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True).stdout.strip())
    shown = [
        subprocess.run(["git", "show", f"{revision}:{path.resolve().relative_to(root.resolve())}"], capture_output=True, text=True)
        for path in cpu_kernels._SOURCES
    ]
    return cpu_kernels.bind(cpu_kernels.compile_library([done.stdout for done in shown if done.returncode == 0]))


def _on(library, call):
    """``call`` with HOT's CPU ops on ``library``."""

    def on_library():
        with unittest.mock.patch.object(cpu_kernels, "library", lambda: library):
            call()

    return on_library


def measure(repeats: int, against) -> list[dict]:
    libraries = {"this": cpu_kernels.library()} | ({"against": against} if against is not None else {})
    rows = []
    for name, m, n in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, n).to(dtype)
            for kernel, call in _kernels(x).items():
                times = interleaved_seconds({tag: _on(library, call) for tag, library in libraries.items()}, repeats)
                rows.append(
                    {"operand": name, "shape": [m, n], "dtype": str(dtype).removeprefix("torch."), "kernel": kernel}
                    | {f"{tag}_ms": statistics.median(t) * 1e3 for tag, t in times.items()}
                )
    return rows


def main() -> None:
    parser = kernel_bench_parser(__doc__.split("\n\n")[0], repeats=25)
    parser.add_argument("--against", help="a git revision whose C++ library runs beside this tree's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args.repeats, library_at(args.against) if args.against else None)
    command = "python tools/quantizer_bench.py --out " + args.out + (f" --against {args.against}" if args.against else "")
    head = "| operand | shape | dtype | kernel | ms | 10⁹ values/s |" + (f" ms at {args.against} | this / {args.against} |" if args.against else "")
    lines = [
        machine_line(machine_info()),
        "",
        f"`{command}`; medians of {args.repeats} interleaved calls",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        m, n = r["shape"]
        cells = [r["operand"], f"{m} × {n}", r["dtype"], r["kernel"], f"{r['this_ms']:.2f}", f"{m * n / r['this_ms'] / 1e6:.2f}"]
        if args.against:
            cells += [f"{r['against_ms']:.2f}", f"{r['this_ms'] / r['against_ms']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    write_table(args.out, "quantizers", {"against": args.against, "rows": rows}, lines)


if __name__ == "__main__":
    main()
