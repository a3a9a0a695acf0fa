"""The half-precision attention backward three ways, alone, at the bench models' heads and smaller
ones: the bf16 flash kernel (Inductor's under autocast), the float32 flash kernel with the casts
around it (``DeviceProfile.fp32_attention_backward``), and HOT's products of the scores
(``hot_compile.runtime.attention_ops``, ``DeviceProfile.attention_backward_products``). Calls are
interleaved, so that a CPU whose rate moves from one second to the next moves all three alike. Each
way's gradient error against the float64 kernel is reported beside its time: the evidence behind a
device profile's two flags and ``attention_precision.MIN_PRODUCTS_WORK``.

    python tools/attention_bench.py --threads 2 --out benchmarks/attention-zen4
"""

from __future__ import annotations

import statistics

import torch

from hot_compile.harness.bench import interleaved_seconds, machine_info
from hot_compile.harness.bench_report import kernel_bench_parser, machine_line, write_table
from hot_compile.passes.attention_precision import FLASH_CPU_BACKWARD
from hot_compile.runtime.attention_ops import attention_backward

FLASH_CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
# [B, H, L, E]: ViT-S's and MiniLM's heads in tools/bench.py, then smaller attentions down to the ViT
# task's (hot_compile.harness.tasks).
SHAPES = ((32, 6, 197, 64), (32, 12, 128, 32), (8, 6, 197, 64), (32, 6, 128, 64), (32, 4, 64, 32), (64, 4, 32, 16), (64, 4, 16, 16))


def _ways(shape: tuple[int, ...], gen: torch.Generator) -> tuple[dict, tuple]:
    q, k, v = (torch.randn(shape, generator=gen).bfloat16() for _ in range(3))
    out, lse = FLASH_CPU_FORWARD(q, k, v, 0.0, False)[:2]
    grad = torch.randn(out.shape, generator=gen).bfloat16()
    operands = (grad, q, k, v, out, lse)
    upcast = tuple(t.float() for t in operands[:5])
    ways = {
        "bf16 kernel": lambda: FLASH_CPU_BACKWARD(*operands, 0.0, False),
        "float32 kernel": lambda: [g.bfloat16() for g in FLASH_CPU_BACKWARD(*(t.float() for t in upcast), lse, 0.0, False)],
        "products": lambda: attention_backward(*operands, shape[-1] ** -0.5),
    }
    return ways, operands


def _error(grads, exact) -> float:
    return max(((g.double() - e).norm() / e.norm()).item() for g, e in zip(grads, exact))


def measure(repeats: int) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        ways, operands = _ways(shape, gen)
        exact = FLASH_CPU_BACKWARD(*(t.double() for t in operands), 0.0, False)
        times = interleaved_seconds(ways, repeats)
        b, h, l, e = shape
        rows.append(
            {"shape": list(shape), "work": b * h * l * l * e}
            | {f"{way} ms": statistics.median(t) * 1e3 for way, t in times.items()}
            | {f"{way} error": _error(call(), exact) for way, call in ways.items()}
        )
    return rows


def main() -> None:
    parser = kernel_bench_parser(__doc__.split("\n\n")[0], repeats=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = measure(args.repeats)
    command = f"python tools/attention_bench.py --threads {args.threads} --repeats {args.repeats} --out {args.out}"
    lines = [
        machine_line(machine_info()),
        "",
        f"`{command}`; medians of {args.repeats} interleaved calls; error: the largest of the three gradients' against float64",
        "",
        "| heads [B, H, L, E] | B·H·L·S·E | bf16 kernel ms | float32 kernel ms | products ms | products / float32 kernel | errors: bf16, float32, products |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = [r[f"{way} ms"] for way in ("bf16 kernel", "float32 kernel", "products")]
        errors = ", ".join(f"{r[f'{way} error']:.4f}" for way in ("bf16 kernel", "float32 kernel", "products"))
        cells = [str(r["shape"]), f"{r['work']:.2e}", *(f"{m:.2f}" for m in ms), f"{ms[2] / ms[1]:.2f}", errors]
        lines.append("| " + " | ".join(cells) + " |")
    write_table(args.out, "attention", {"threads": args.threads, "rows": rows}, lines)


if __name__ == "__main__":
    main()
