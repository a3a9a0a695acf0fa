"""Peak memory of one training step per variant, each variant in a process of its own.

``tools/bench.py`` runs every variant in one process, so its peak RSS is the process's high-water
mark, shared by all of them. Here each (model, variant) pair gets a fresh interpreter that builds the
model, compiles it, runs warm-up steps, hands the heap's free memory back to the system
(``malloc_trim``, so that what the compile and the warm-up steps left behind does not count), then
resets the kernel's peak-RSS counter (``VmHWM``) and runs one more step. glibc's settings in the
environment (``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``) reach every child and are written beside
the command: how much of the heap a step's freed blocks leave unusable depends on them. Reported: that step's peak
RSS, its growth over the RSS before the step, the most bytes of tensors the step holds at once (the
CPU counterpart of CUDA's ``max_memory_allocated``, from a further step under ``torch.profiler``:
no libraries, compiled code or allocator holdings in it), and the bytes saved for backward, with
ratios against Inductor bf16 (the variant a user of a CPU with bf16 runs; Inductor fp32 where bf16
is not measured).

    python tools/step_memory.py --out benchmarks/memory-zen4    # writes step_memory.{json,md}
    python tools/step_memory.py --models resnet --hot-policy hot --out benchmarks/memory-zen4-conv
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import subprocess
import sys

MIB = 1 << 20
WARMUP = 2


def _child(model: str, variant: str, threads: int, hot_policy: str | None, compress_saved: int | None) -> dict:
    import torch

    from hot_compile.harness import bench_cases

    torch.set_num_threads(threads)
    spec = bench_cases.BenchSpec(
        models=(model,), variants=(variant,), fresh_cache=False, hot_policy=hot_policy, hot_compress_saved=compress_saved
    )
    case = bench_cases.build_case(model, spec)
    if isinstance(case, str):
        return {"model": model, "variant": variant, "skipped": case}
    runner = bench_cases.Runner(variant, case, fresh_cache=False, options=spec.hot_options())
    runner.first_step()
    for i in range(WARMUP):
        runner.step(i + 1)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    peak, growth = runner.peak_rss()
    return {
        "model": model,
        "variant": variant,
        "peak_rss_bytes": peak,
        "step_rss_growth_bytes": growth,
        "peak_live_bytes": runner.peak_live_bytes(),  # after the RSS step: the profiler's records add to RSS
        "saved_bytes": runner.saved_bytes(),
    }


def _markdown(rows: list[dict], command: str, machine: dict) -> str:
    from hot_compile.harness.bench_report import machine_line

    lines = [
        machine_line(machine),
        "",
        f"`{command}`",
        "",
        "| model | variant | peak RSS of a step MiB | vs baseline | step RSS growth MiB | peak live tensors MiB | vs baseline | saved for backward MiB | vs baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['model']} | {row['variant']} | skipped: {row['skipped']} | | | | | | |")
            continue
        base = next(
            (r for v in ("inductor-bf16", "inductor-fp32") for r in rows if r["model"] == row["model"] and r["variant"] == v and "skipped" not in r),
            row,
        )  # fmt: skip
        lines.append(
            f"| {row['model']} | {row['variant']} | {row['peak_rss_bytes'] / MIB:.0f} | "
            f"{row['peak_rss_bytes'] / base['peak_rss_bytes']:.2f} | {row['step_rss_growth_bytes'] / MIB:.0f} | "
            f"{row['peak_live_bytes'] / MIB:.0f} | {row['peak_live_bytes'] / base['peak_live_bytes']:.2f} | "
            f"{row['saved_bytes'] / MIB:.1f} | {row['saved_bytes'] / max(base['saved_bytes'], 1):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from hot_compile.config import POLICIES
    from hot_compile.harness import bench, bench_cases

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_selection_arguments(parser, bench_cases.HOT_AND_INDUCTOR)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hot-policy", choices=POLICIES, default=None, help="HotConfig.policy of the hot variants (default: none given)")
    parser.add_argument("--hot-compress-saved", type=int, choices=(0, 1), default=None, help="HotConfig.compress_saved of the hot variants (default: none given)")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child, args.threads, args.hot_policy, args.hot_compress_saved)))
        return 0
    rows = []
    for model in args.models:
        for variant in args.variants:
            command = [sys.executable, __file__, "--child", model, variant, "--threads", str(args.threads), "--out", "-"]
            command += ["--hot-policy", args.hot_policy] if args.hot_policy else []
            command += ["--hot-compress-saved", str(args.hot_compress_saved)] if args.hot_compress_saved is not None else []
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = {**bench.machine_info(), "threads": args.threads}
    (args.out / "step_memory.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    settings = bench.env_assignments(machine["allocator_env"] | machine.get("cpu_class_env", {}))
    command = " ".join([*settings, "python tools/step_memory.py", *(argv if argv is not None else sys.argv[1:])])
    (args.out / "step_memory.md").write_text(_markdown(rows, command, machine))
    print(_markdown(rows, command, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
