"""Side-by-side speed and memory benchmark of ``backend="hot"`` against Inductor, in one process.

Every variant of a model is compiled from the same initial weights, then the variants take turns step
by step (the starting variant rotates, the inputs rotate through a small pool), so a machine whose load
drifts slows them all alike and the ratios between them stay meaningful. Figures per variant:

* forward+backward and backward-alone time: medians over the timed steps, after warm-up; against
  Inductor at the same precision, also the step's ratio paired by round (:func:`paired_ratio`);
* bytes saved for backward: every tensor packed by ``saved_tensors_hooks`` during one forward,
  counted once per storage, parameters excluded (casts of parameters, e.g. bf16 weights under
  autocast, are counted: the backward holds them);
* peak RSS during a step, and its growth over the RSS before the step (Linux ``clear_refs``);
* compile time: the first forward+backward (both graphs compiled, fresh Inductor caches unless asked
  otherwise) minus the median step, after one throwaway compile has paid the process's one-time
  set-up; for hot variants, the part of it spent building the kernels of HOT's ops (shared by every
  model and shape in a process, then found in Inductor's cache), and the ratio without it;
* gradient error: ``‖g − g₆₄‖ / ‖g₆₄‖`` over all parameter gradients of one step against the same model
  in float64, run eagerly (the largest per-parameter error goes to the JSON).

Inputs of the MLP and ViT models are smooth along tokens (a few low-frequency components plus noise),
like image patches and the activations of trained transformers; HOT's low-rank grad_weight relies on
that correlation, and white noise would show only its worst case.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import time
from typing import Any, Callable

import torch

from ..config import POLICIES
from ..device_calibration import median_seconds
from .bench_cases import MODELS, PROBE_SIZE, TINY, VARIANTS, BenchSpec, Case, Runner, build_case, reference_grads, take_steps, variant_unavailable
from .bench_report import SECTION_TITLE, markdown, merge, update_section, write_outputs

# --------------------------------------------------------------------------------------------- run

# Each hot variant's ratios are taken against Inductor at its own precision, and against fp32.
_SAME_PRECISION = {"hot-fp32": "inductor-fp32", "hot-bf16": "inductor-bf16", "torchao-int8": "inductor-fp32"}
_BASELINE = "inductor-fp32"


# Environment variables that change how the process allocates memory. On CPUs, a tensor larger than
# glibc's mmap threshold (32 MiB at most) is mapped fresh and faults on every page at its first write;
# the tunables that keep freed memory in the heap change a step's time, so a run records them.
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
# Environment variables that run a lower CPU class's code (README, "Benchmarks"): HOT's
# (hot_compile.runtime.devices.cpu_class) and torch's own kernels kept to that class's instructions.
CPU_CLASS_ENV = ("HOT_CPU_CLASS", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def _environment(names: tuple[str, ...]) -> dict[str, str]:
    return {name: os.environ[name] for name in names if os.environ.get(name)}


def allocator_env() -> dict[str, str]:
    """The allocator settings of this process's environment (:data:`ALLOCATOR_ENV` that are set)."""
    return _environment(ALLOCATOR_ENV)


def cpu_class_env() -> dict[str, str]:
    """The CPU-class settings of this process's environment (:data:`CPU_CLASS_ENV` that are set)."""
    return _environment(CPU_CLASS_ENV)


def env_assignments(env: dict[str, str]) -> list[str]:
    """``env`` (:func:`allocator_env`, :func:`cpu_class_env`) as the ``NAME=value`` words that start a
    command line reproducing a run."""
    return [f"{name}={value}" for name, value in env.items()]


def machine_info() -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16") if f in flags]
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "isa": isa,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "allocator_env": allocator_env(),
        "cpu_class_env": cpu_class_env(),
    }


# The side of the square float32 matmul that measures the machine's speed at each end of a run.
def matmul_gflops(size: int = PROBE_SIZE, repeats: int = 5) -> float:
    """float32 GFLOP/s of one ``[size, size] @ [size, size]`` matmul, median of ``repeats``: how fast
    this machine runs right now. A shared VM's speed drifts between runs by tens of percent; the
    ratios within one run, its variants interleaved, do not."""
    a = torch.randn(size, size)
    return 2 * size**3 / median_seconds(lambda: a @ a, repeats) / 1e9


def interleaved_seconds(calls: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of ``repeats`` calls of each of ``calls``, one of each in turn per round after ``warmup``
    untimed rounds, so that a machine whose speed moves from one second to the next moves all alike."""
    times: dict[str, list[float]] = {key: [] for key in calls}
    for i in range(warmup + repeats):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            if i >= warmup:
                times[key].append(time.perf_counter() - start)
    return times


def paired_ratio(steps: list[float], reference: list[float]) -> float:
    """The median over rounds of ``steps[i] / reference[i]``: both sides' steps of round ``i`` ran
    seconds apart, so a drift of the machine's speed between rounds cancels."""
    if len(steps) != len(reference) or not steps:
        raise ValueError(f"paired_ratio: {len(steps)} and {len(reference)} steps; one each per round is needed")
    return statistics.median(s / r for s, r in zip(steps, reference))


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else math.nan


def initialize_compiler() -> None:
    """One throwaway compile, so that no variant's compile time includes the process's one-time set-up
    (imports, C++ toolchain probing) just because it ran first."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache():
        torch.compile(lambda t: t.sin() + 1)(torch.ones(8))
    torch._dynamo.reset()


def run_case(case: Case, spec: BenchSpec, log: Callable[[str], None]) -> list[dict[str, Any]]:
    torch._dynamo.reset()
    runners = []
    for variant in spec.variants:
        why = variant_unavailable(variant)
        if why:
            log(f"  {variant}: skipped, {why}")
            continue
        runner = Runner(variant, case, spec.fresh_cache, spec.hot_options())
        runner.first_step()
        log(f"  {variant}: first step (compile) {runner.first_step_s:.1f} s")
        runners.append(runner)
    take_steps(runners, spec.warmup, spec.repeats)
    reference = reference_grads(case)
    rows = []
    for r in runners:
        peak, growth = r.peak_rss()
        err, worst = r.grad_error(reference)
        bwd, total = _median_ms(r.bwd), _median_ms(r.fwd_bwd)
        rows.append(
            {
                "model": case.name,
                "variant": r.variant,
                "fwd_bwd_ms": total,
                "bwd_ms": bwd,
                "fwd_bwd_ms_all": [t * 1e3 for t in r.fwd_bwd],
                "bwd_ms_all": [t * 1e3 for t in r.bwd],
                "saved_bytes": r.saved_bytes(),
                "peak_rss_bytes": peak,
                "step_rss_growth_bytes": growth,
                "compile_s": r.first_step_s - total / 1e3,
                "kernel_build_s": r.kernel_build_s,
                "model_compile_s": r.first_step_s - total / 1e3 - r.kernel_build_s,
                "grad_rel_err": err,
                "grad_rel_err_max_param": worst,
                "hot_sites": r.hot_rows,
            }
        )
        log(f"  {r.variant}: bwd {bwd:.1f} ms, fwd+bwd {total:.1f} ms, grad err {err:.3g}")
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    by_variant = {r["variant"]: r for r in rows}

    def ratio(row, other, key):
        base = by_variant.get(other)
        return row[key] / base[key] if base and base[key] and row[key] is not None else None

    for row in rows:
        same = _SAME_PRECISION.get(row["variant"], row["variant"])
        row["bwd_vs_inductor_fp32"] = ratio(row, _BASELINE, "bwd_ms")
        row["fwd_bwd_vs_inductor_fp32"] = ratio(row, _BASELINE, "fwd_bwd_ms")
        row["bwd_vs_same_precision"] = ratio(row, same, "bwd_ms")
        row["fwd_bwd_vs_same_precision"] = ratio(row, same, "fwd_bwd_ms")
        reference = by_variant.get(same)
        row["fwd_bwd_vs_same_precision_paired"] = (
            paired_ratio(row["fwd_bwd_ms_all"], reference["fwd_bwd_ms_all"]) if reference and row.get("fwd_bwd_ms_all") else None
        )
        row["saved_vs_inductor_fp32"] = ratio(row, _BASELINE, "saved_bytes")
        row["compile_vs_same_precision"] = ratio(row, same, "compile_s")
        row["model_compile_vs_same_precision"] = ratio(row, same, "model_compile_s")
        sites = [s for s in row["hot_sites"] if s.get("decision") == "HLA+ABC" and s.get("saved_bytes_after")]
        # Bytes the backward keeps of each rewritten linear's or convolution's input, over that input in float32.
        fp32_input = [s["saved_bytes_before"] * 4 // _itemsize(s["dtype"]) for s in sites]
        row["abc_saved_vs_fp32_input_max"] = max(
            (s["saved_bytes_after"] / b for s, b in zip(sites, fp32_input)), default=None
        )


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def run(spec: BenchSpec, log: Callable[[str], None] = print) -> dict[str, Any]:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    gflops_before = matmul_gflops()
    result: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "spec": dataclasses.asdict(spec),
        "cases": [],
        "skipped": {},
    }
    initialize_compiler()
    for name in spec.models:
        case = build_case(name, spec)
        if isinstance(case, str):
            log(f"{name}: skipped, {case}")
            result["skipped"][name] = case
            continue
        log(f"{name}: {case.description}")
        result["cases"].append({"model": name, "description": case.description, "rows": run_case(case, spec, log)})
    result["load_average"] = {"start": load_before, "end": os.getloadavg() if load_before else None}
    result["matmul_gflops"] = {"start": gflops_before, "end": matmul_gflops()}
    return result


# --------------------------------------------------------------------------------------------- CLI


def _names(kind: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(value: str) -> tuple[str, ...]:
        names = tuple(v.strip() for v in value.split(",") if v.strip())
        bad = [n for n in names if n not in kind]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{value!r}: give a comma-separated subset of {','.join(kind)}")
        return names

    return parse


def add_selection_arguments(parser: argparse.ArgumentParser, variants: tuple[str, ...] = VARIANTS) -> None:
    """``--models`` and ``--variants``: which cases and variants to run, as comma-separated names."""
    parser.add_argument("--models", type=_names(MODELS), default=MODELS, help=f"subset of {','.join(MODELS)}")
    parser.add_argument("--variants", type=_names(VARIANTS), default=variants, help=f"subset of {','.join(VARIANTS)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = BenchSpec()
    add_selection_arguments(parser, defaults.variants)
    parser.add_argument("--tiny", action="store_true", help="toy sizes and few steps: a smoke run in seconds")
    for field in dataclasses.fields(BenchSpec):
        if field.name in ("models", "variants", "fresh_cache", "hot_policy"):
            continue
        parser.add_argument("--" + field.name.replace("_", "-"), type=int, default=None, help=f"default {field.default}")
    parser.add_argument(
        "--hot-policy", choices=POLICIES, default=defaults.hot_policy, help="HotConfig.policy of the hot variants (default: none given)"
    )
    parser.add_argument("--warm-cache", action="store_true", help="keep Inductor's caches (compile time is then a cache load)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"), help="folder for bench.json/.md/.png")
    parser.add_argument(
        "--from-json", nargs="+", type=pathlib.Path, default=None, help="render earlier bench.json files (merged) instead of running"
    )
    parser.add_argument("--benchmarks-md", type=pathlib.Path, default=None, help=f"also rewrite the '{SECTION_TITLE}' section of this file")


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    values: dict[str, Any] = dict(TINY) if args.tiny else {}
    for field in dataclasses.fields(BenchSpec):
        given = getattr(args, field.name, None)
        if field.name not in ("models", "variants", "fresh_cache") and given is not None:
            values[field.name] = given
    return BenchSpec(models=args.models, variants=args.variants, fresh_cache=not args.warm_cache, **values)


def command_line(args: argparse.Namespace, prog: str) -> str:
    """The command that reproduces ``args``: the environment's allocator settings, ``prog``, and every
    setting that differs from the default."""
    spec, defaults = spec_from_args(args), BenchSpec()
    parts = env_assignments(allocator_env() | cpu_class_env()) + shlex.split(prog)
    for field in dataclasses.fields(BenchSpec):
        value = getattr(spec, field.name)
        if value == getattr(defaults, field.name):
            continue
        if field.name == "fresh_cache":
            parts.append("--warm-cache")
            continue
        parts += ["--" + field.name.replace("_", "-"), ",".join(value) if isinstance(value, tuple) else str(value)]
    parts += ["--out", str(args.out)]
    if args.benchmarks_md is not None:
        parts += ["--benchmarks-md", str(args.benchmarks_md)]
    return shlex.join(parts)


def run_from_args(args: argparse.Namespace, prog: str = "hot-compile bench") -> int:
    if args.from_json:
        result = merge([json.loads(pathlib.Path(p).read_text()) for p in args.from_json])
        for case in result["cases"]:  # a stored run may predate some ratio: all are derived again
            _add_ratios(case["rows"])
        command = None
    else:
        command = command_line(args, prog)
        result = run(spec_from_args(args), log=lambda s: print(s, flush=True))
    paths = write_outputs(result, args.out, command)
    body = markdown(result, command)
    print(body)
    if args.benchmarks_md is not None:
        if "png" in paths:
            body += f"\n![backward time and saved bytes]({os.path.relpath(paths['png'], args.benchmarks_md.parent)})\n"
        update_section(args.benchmarks_md, SECTION_TITLE, body)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``hot-compile bench`` subcommand."""
    parser = sub.add_parser("bench", help="side-by-side speed and memory benchmark against Inductor")
    add_arguments(parser)
    parser.set_defaults(run=run_from_args)


def main(argv: list[str] | None = None, prog: str = "python tools/bench.py") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv), prog)
