"""Per-op profile of one training step per variant (``torch.profiler``), the evidence behind the
speed figures of ``tools/bench.py``.

Each variant of ``tools/bench.py`` is compiled, warmed up, and one step is profiled. Reported per
variant: the step's forward and backward time, and the operators by self CPU time, among them the
integer GEMM (``aten::_int_mm``) and HOT's ops (``hot_compile::*``, whose total includes the GEMM
they call). The time of a HOT op minus its GEMM is what its transforms and quantizers cost.

    python tools/profile_step.py --models mlp,vit,minilm --out benchmarks/profile-zen4
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from hot_compile.harness import bench, bench_cases, bench_report

ROWS = 12
WARMUP = 3


def _table(prof, limit: int) -> list[tuple[str, float, float, int]]:
    """(name, self ms, total ms, calls) of the operators with the most self time, and HOT's ops."""
    events = [e for e in prof.key_averages() if not e.key.startswith(("## Call", "Torch-Compiled", "Compiled"))]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    chosen = events[:limit] + [e for e in events[limit:] if e.key.startswith("hot_compile::")]
    return [(e.key, e.self_cpu_time_total / 1e3, e.cpu_time_total / 1e3, e.count) for e in chosen]


def profile_model(model: str, variants: tuple[str, ...], threads: int) -> str:
    torch.set_num_threads(threads)
    spec = bench_cases.BenchSpec(models=(model,), variants=variants, fresh_cache=False)
    case = bench_cases.build_case(model, spec)
    if isinstance(case, str):
        return f"**{model}**: skipped, {case}\n"
    runners = [bench_cases.Runner(v, case, fresh_cache=False, options=spec.hot_options()) for v in variants]
    for runner in runners:
        runner.first_step()
    for i in range(WARMUP):
        for runner in runners:
            runner.step(i + 1)
    out = [f"**{model}** — {case.description}", ""]
    for runner in runners:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            total, backward = runner.step(1)
        out += [
            f"*{runner.variant}*: fwd+bwd {total * 1e3:.0f} ms (forward {(total - backward) * 1e3:.0f}, "
            f"backward {backward * 1e3:.0f}), profiled",
            "",
            "| operator | self ms | total ms | calls |",
            "|---|---|---|---|",
        ]
        out += [f"| `{name}` | {self_ms:.1f} | {total_ms:.1f} | {calls} |" for name, self_ms, total_ms, calls in _table(prof, ROWS)]
        out.append("")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_selection_arguments(parser, bench_cases.HOT_AND_INDUCTOR)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    command = "python tools/profile_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = [f"`{command}`", "", bench_report.machine_line(bench.machine_info()), ""]
    for model in args.models:
        text.append(profile_model(model, args.variants, args.threads))
        print(text[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.md").write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
