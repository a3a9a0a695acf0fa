"""Compile time of ``backend="hot"`` against Inductor as a user meets it: each compile in a new process.

HOT's kernels (:mod:`hot_compile.runtime.ops`) are shape-generic: the first model compiled with
``backend="hot"`` on a machine builds them, and every later process finds them in Inductor's FX graph
cache, whatever its model. On the CPU they are one C++ library, which ``make install`` builds and HOT's
own cache keeps (:mod:`hot_compile.runtime.cpu_kernels`): a new Inductor cache does not drop it. So a
model's first compile is measured twice per backend:

* **first use**: in a new Inductor cache; HOT builds its kernels;
* **after a primer**: in a cache where another model (the *primer*) was compiled first with the same
  backend; HOT loads its kernels, the model's own graphs are compiled from scratch. Inductor gets the
  same primer, so that neither backend reuses C++ kernels the other did not compile.

Per repeat, six processes: the model under each backend in a new cache, and the primer then the model
under each backend in another new cache. A process's compile time is its first forward+backward minus
its median step, after one throwaway compile has paid the process's set-up
(:func:`hot_compile.harness.bench.run_case` measures the same way, in one process). Ratios are hot / inductor
within a repeat and scenario.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable

import torch
from torch._dynamo.utils import counters

from ..config import POLICIES
from . import bench, bench_cases, bench_report

SECTION_TITLE = "Compile time across processes"
# The primer is an MLP block at bench's default width with 16 × 196 tokens: float32 like the models,
# and long enough that HLA's contraction (half the tokens at rank 8) runs in pieces, as the models'
# does. A primer taking other code paths would leave kernels to build, which the figures would show
# as a long "HOT kernels" time, and graphs compiled rather than found, after the primer.
PRIMER = "mlp"
PRIMER_BATCH = 16
MODELS = ("vit", "minilm", "mlp")
PRECISIONS = ("fp32", "bf16")  # bf16: the forward under torch.autocast("cpu", torch.bfloat16), as bench.py's variants


@dataclasses.dataclass(frozen=True)
class CompileBenchSpec:
    model: str = "vit"
    repeats: int = 2
    steps: int = 3
    threads: int | None = None
    hot_policy: str | None = None  # None: the default, no option
    precision: str = "fp32"

    def __post_init__(self):
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r}: accepted are {MODELS}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: accepted are {PRECISIONS}")
        if self.hot_policy is not None and self.hot_policy not in POLICIES:
            raise ValueError(f"hot_policy={self.hot_policy!r}: accepted are {POLICIES}")
        if self.repeats < 1 or self.steps < 1:
            raise ValueError(f"repeats and steps must be ≥ 1, got {self.repeats} and {self.steps}")


def measure(variant: str, model: str, batch: int | None, steps: int, hot_policy: str | None) -> dict[str, float]:
    """In this process: ``model`` compiled as ``variant`` with the current Inductor cache; its compile
    seconds (first step minus the median of ``steps`` more), the part of them building or loading
    HOT's kernels, and how many graphs the first step found in Inductor's FX graph cache and how many
    it compiled."""
    spec = bench_cases.BenchSpec(models=(model,), variants=(variant,), fresh_cache=False, hot_policy=hot_policy,
                           **({"batch": batch} if batch else {}))  # fmt: skip
    case = bench_cases.build_case(model, spec)
    if isinstance(case, str):
        raise RuntimeError(f"{model}: {case}")
    bench.initialize_compiler()
    runner = bench_cases.Runner(variant, case, fresh_cache=False, options=spec.hot_options())
    cache = counters["inductor"]
    hits, misses = cache["fxgraph_cache_hit"], cache["fxgraph_cache_miss"]
    runner.first_step()
    for i in range(steps):
        runner.timed_step(i + 1)
    step_s = statistics.median(runner.fwd_bwd)
    return {
        "compile_s": runner.first_step_s - step_s,
        "kernel_s": runner.kernel_build_s,
        "step_s": step_s,
        "cache_hits": cache["fxgraph_cache_hit"] - hits,
        "cache_misses": cache["fxgraph_cache_miss"] - misses,
    }


ChildRunner = Callable[[str, str, "int | None", pathlib.Path], dict[str, float]]


def child_process(spec: CompileBenchSpec) -> ChildRunner:
    """A runner of :func:`measure` in a new Python process whose Inductor cache is ``cache_dir``."""

    def run_child(variant: str, model: str, batch: int | None, cache_dir: pathlib.Path) -> dict[str, float]:
        request = {"variant": variant, "model": model, "batch": batch, "steps": spec.steps, "hot_policy": spec.hot_policy}
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
        if spec.threads:
            env["OMP_NUM_THREADS"] = str(spec.threads)
        done = subprocess.run(
            [sys.executable, "-m", "hot_compile.harness.compile_bench", "--child", json.dumps(request)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"{variant} on {model} failed:\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run_child


SCENARIOS = ("first_use", "after_primer")


def _in_new_cache(run_child: ChildRunner, variant: str, model: str, primer: bool) -> dict[str, Any]:
    """``model``'s compile under ``variant`` in a new Inductor cache, after the primer's when ``primer``."""
    with tempfile.TemporaryDirectory() as directory:
        cache = pathlib.Path(directory)
        before = run_child(variant, PRIMER, PRIMER_BATCH, cache) if primer else None
        return {**run_child(variant, model, None, cache), "primer": before}


def run(spec: CompileBenchSpec, run_child: ChildRunner | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    run_child = run_child or child_process(spec)
    if spec.threads:
        # Recorded by machine_info as the children's thread count.
        torch.set_num_threads(spec.threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    repeats = []
    for i in range(spec.repeats):
        row: dict[str, Any] = {}
        for scenario in SCENARIOS:
            inductor = _in_new_cache(run_child, f"inductor-{spec.precision}", spec.model, scenario == "after_primer")
            hot = _in_new_cache(run_child, f"hot-{spec.precision}", spec.model, scenario == "after_primer")
            row[scenario] = {"inductor": inductor, "hot": hot, "hot_vs_inductor": hot["compile_s"] / inductor["compile_s"]}
        log(
            f"repeat {i + 1}: "
            + "; ".join(
                f"{scenario.replace('_', ' ')}: inductor {row[scenario]['inductor']['compile_s']:.1f} s, "
                f"hot {row[scenario]['hot']['compile_s']:.1f} s"
                for scenario in SCENARIOS
            )
        )
        repeats.append(row)
    return {
        "date": started.isoformat(timespec="seconds"),
        "machine": bench.machine_info(),
        "spec": dataclasses.asdict(spec),
        "primer": {"model": PRIMER, "batch": PRIMER_BATCH},
        "repeats": repeats,
        "median_hot_vs_inductor": {s: statistics.median(r[s]["hot_vs_inductor"] for r in repeats) for s in SCENARIOS},
    }


def _cache_use(figures: dict[str, Any]) -> str:
    return f"{figures['cache_hits']}/{figures['cache_misses']}"


def markdown(result: dict[str, Any], command: str | None = None) -> str:
    lines = [
        bench_report.machine_line(result["machine"]) + f" Run {result['date']}" + (f": `{command}`" if command else "") + ".",
        "",
        f"Model: {result['spec']['model']} (bench.py's sizes), {result['spec']['precision']}; "
        f"hot: `options={bench_cases.hot_options(result['spec']['hot_policy'])}`. "
        f"Primer: {result['primer']['model']}, batch {result['primer']['batch']}, under the same backend "
        "in the same cache. Compile: first step minus the median step of the same process; HOT kernels: "
        "the part of it spent building (first use) or loading (after a primer) the kernels of HOT's ops; "
        "graphs: found in Inductor's FX graph cache / compiled, by the model's first step.",
        "",
        "| repeat | scenario | inductor s | hot s | HOT kernels s | hot / inductor | graphs inductor | graphs hot |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(result["repeats"], 1):
        for scenario in SCENARIOS:
            inductor, hot = r[scenario]["inductor"], r[scenario]["hot"]
            lines.append(
                f"| {i} | {scenario.replace('_', ' ')} | {inductor['compile_s']:.1f} | {hot['compile_s']:.1f} | "
                f"{hot['kernel_s']:.1f} | {r[scenario]['hot_vs_inductor']:.2f} | {_cache_use(inductor)} | {_cache_use(hot)} |"
            )
    med = result["median_hot_vs_inductor"]
    lines += [
        "",
        f"Median hot / inductor: **{med['first_use']:.2f}** on first use, **{med['after_primer']:.2f}** after a primer.",
    ]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    defaults = CompileBenchSpec()
    parser = argparse.ArgumentParser(prog="python tools/compile_time.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default=defaults.model)
    parser.add_argument("--repeats", type=int, default=defaults.repeats, help="rounds of the six processes")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="steps after the first, for the median step")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the processes")
    parser.add_argument("--hot-policy", choices=POLICIES, default=defaults.hot_policy)
    parser.add_argument("--precision", choices=PRECISIONS, default=defaults.precision, help="bf16: the forward under autocast")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("compile_time_out"), help="folder for compile_time.json/.md")
    parser.add_argument("--benchmarks-md", type=pathlib.Path, default=None, help=f"also rewrite the '{SECTION_TITLE}' section of this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child is not None:
        request = json.loads(args.child)
        print(json.dumps(measure(**request)))
        return 0
    spec = CompileBenchSpec(model=args.model, repeats=args.repeats, steps=args.steps, threads=args.threads,
                            hot_policy=args.hot_policy, precision=args.precision)  # fmt: skip
    command = shlex.join(["python", "tools/compile_time.py", *(argv if argv is not None else sys.argv[1:])])
    result = run(spec, log=lambda s: print(s, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_time.json").write_text(json.dumps({**result, "command": command}, indent=1))
    body = markdown(result, command)
    (args.out / "compile_time.md").write_text(body)
    print(body)
    if args.benchmarks_md is not None:
        bench_report.update_section(args.benchmarks_md, SECTION_TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
