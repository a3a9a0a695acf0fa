"""The benchmark's outputs: ``bench.md`` (tables of ratios), ``bench.json``, ``bench.png``, and the
section of BENCHMARKS.md it rewrites."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from typing import Any

from .bench_cases import MIB, PROBE_SIZE, hot_options

SECTION_TITLE = "Speed and memory"

# ------------------------------------------------------------------------------------------ output


def _fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def _mib(n) -> str:
    return _fmt(None if n is None else n / MIB, ".2f")


def _run_line(run: dict[str, Any]) -> str:
    load = run.get("load_average") or {}
    line = f"Run {run['date']}"
    if load.get("start"):
        line += f", load average (1 min) {load['start'][0]:.1f} at the start and {load['end'][0]:.1f} at the end"
    gflops = run.get("matmul_gflops")
    if gflops:
        line += f", a float32 {PROBE_SIZE}³ matmul at {gflops['start']:.0f} GFLOP/s at the start and {gflops['end']:.0f} at the end"
    return line + (f": `{run['command']}`" if run.get("command") else "")


def machine_line(m: dict[str, Any]) -> str:
    """The Markdown line that names the machine of :func:`machine_info` ``m``."""
    line = (
        f"Machine: {m['cpu']} ({m['cores']} cores; {', '.join(m['isa']) or 'no AVX-512'}), torch {m['torch']}, "
        f"{m['threads']} threads; allocator: "
        + (" ".join(f"`{k}={v}`" for k, v in m.get("allocator_env", {}).items()) or "glibc malloc defaults")
        + "."
    )
    env = m.get("cpu_class_env", {})
    if env.get("HOT_CPU_CLASS"):
        line += f" Run as the {env['HOT_CPU_CLASS']} CPU class: " + " ".join(f"`{k}={v}`" for k, v in env.items()) + "."
    return line


def markdown(result: dict[str, Any], command: str | None = None) -> str:
    lines = [machine_line(result["machine"])]
    runs = result.get("runs") or [{**result, "command": command or result.get("command")}]
    lines += ["", *(f"- {_run_line(run)}" for run in runs)]
    spec = result["spec"]
    options = hot_options(spec.get("hot_policy"), spec.get("hot_forward_bits"))
    call = f'`torch.compile(model, backend="hot", options={options})`' if options else (
        '`torch.compile(model, backend="hot")`, the defaults (no options)'
    )
    lines += [
        "",
        f"hot variants: {call}; "
        "bf16 variants run the forward under `torch.autocast(\"cpu\", torch.bfloat16)`.",
        "",
        f"Medians of {spec['repeats']} interleaved steps after {spec['warmup']} warm-up steps; ratios are against "
        "inductor fp32 (\"vs fp32\") and against Inductor at the same precision (\"vs same\"): of the medians, and "
        "(\"paired\") the median over rounds of the two steps' ratio within a round, which a drift of the machine "
        "from one round to the next moves less. Saved: bytes held for "
        "backward (parameters excluded). RSS growth: peak RSS during a step minus RSS before it. Compile: first "
        f"step minus a median step ({'fresh' if spec['fresh_cache'] else 'warm'} Inductor caches); HOT kernels: the "
        "part of it spent building the kernels of HOT's ops, once per process and configuration, shared by every "
        "model and shape; \"w/o kernels\": the compile ratio without that part. "
        "Grad err: relative error of all parameter gradients vs float64.",
    ]
    header = (
        "| variant | fwd+bwd ms | fwd+bwd vs same | paired | bwd ms | bwd vs fp32 | bwd vs same | saved MiB | saved vs fp32 | "
        "peak RSS MiB | RSS growth MiB | compile s | HOT kernels s | compile vs same | w/o kernels vs same | grad err |"
    )
    for case in result["cases"]:
        lines += ["", f"**{case['model']}** — {case['description']}", "", header, "|" + "---|" * 16]
        for r in case["rows"]:
            lines.append(
                f"| {r['variant']} | {_fmt(r['fwd_bwd_ms'])} | {_fmt(r.get('fwd_bwd_vs_same_precision'), '.2f')} "
                f"| {_fmt(r.get('fwd_bwd_vs_same_precision_paired'), '.2f')} "
                f"| {_fmt(r['bwd_ms'])} | {_fmt(r['bwd_vs_inductor_fp32'], '.2f')} "
                f"| {_fmt(r['bwd_vs_same_precision'], '.2f')} | {_mib(r['saved_bytes'])} "
                f"| {_fmt(r['saved_vs_inductor_fp32'], '.3f')} | {_mib(r['peak_rss_bytes'])} "
                f"| {_mib(r['step_rss_growth_bytes'])} | {_fmt(r['compile_s'])} | {_fmt(r.get('kernel_build_s'))} "
                f"| {_fmt(r['compile_vs_same_precision'], '.2f')} | {_fmt(r.get('model_compile_vs_same_precision'), '.2f')} "
                f"| {_fmt(r['grad_rel_err'], '.2g')} |"
            )
        for r in case["rows"]:
            if r.get("abc_saved_vs_fp32_input_max") is not None:
                lines += [
                    "",
                    f"{r['variant']}: each rewritten linear or convolution keeps at most "
                    f"{r['abc_saved_vs_fp32_input_max']:.4f} × the bytes of its float32 input "
                    "(a linear at rank r keeps r/64 plus one scale per channel: 1/4 at rank 16, 1/8 at rank 8; "
                    "a convolution 1/4 plus one scale per channel).",
                ]
    for name, why in result.get("skipped", {}).items():
        lines += ["", f"**{name}**: skipped, {why}."]
    return "\n".join(lines) + "\n"


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs (one model each, say): their cases in order, every run listed."""
    merged = {**results[0], "cases": [], "skipped": {}, "runs": []}
    for result in results:
        merged["cases"] += result["cases"]
        merged["skipped"].update(result.get("skipped", {}))
        merged["runs"] += result.get("runs") or [
            {k: result.get(k) for k in ("date", "command", "load_average", "matmul_gflops", "spec")}
        ]
    return merged


def bar_chart(result: dict[str, Any], path: pathlib.Path) -> bool:
    """Backward time and saved bytes per variant, one pair of panels per model; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = result["cases"]
    fig, axes = plt.subplots(2, max(len(cases), 1), figsize=(4.5 * max(len(cases), 1), 7), squeeze=False)
    for col, case in enumerate(cases):
        names = [r["variant"] for r in case["rows"]]
        colors = ["#4c72b0" if n.startswith("inductor") else "#dd8452" if n.startswith("hot") else "#55a868" for n in names]
        for row, key, label in ((0, "bwd_ms", "backward ms (median)"), (1, "saved_bytes", "saved for backward, MiB")):
            values = [(r[key] or 0) / (MIB if key == "saved_bytes" else 1) for r in case["rows"]]
            ax = axes[row][col]
            ax.bar(range(len(names)), values, color=colors)
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(case["model"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def update_section(path: pathlib.Path, title: str, body: str) -> None:
    """Replace the ``## title`` section of a Markdown file (created if absent), keeping the rest."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    heading = f"## {title}"
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    new = [heading, "", *body.rstrip("\n").splitlines()]
    if start is None:
        while lines and not lines[-1].strip():
            lines.pop()
        lines += ["", *new]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = new + ([""] if end < len(lines) else [])
    path.write_text("\n".join(lines) + "\n")


def write_outputs(result: dict[str, Any], out_dir: pathlib.Path, command: str | None) -> dict[str, pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md", "png": out_dir / "bench.png"}
    if command is not None:
        result = {**result, "command": command}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["markdown"].write_text(markdown(result, command))
    if not bar_chart(result, paths["png"]):
        del paths["png"]
    return paths


def kernel_bench_parser(description: str, repeats: int) -> argparse.ArgumentParser:
    """The arguments of the tools that time kernels alone, outside a model: ``--threads``,
    ``--repeats`` (timed calls of each kernel) and ``--out`` (a folder)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--out", required=True)
    return parser


def write_table(out: str | pathlib.Path, stem: str, data: dict[str, Any], lines: list[str]) -> None:
    """A kernel tool's results under ``out``: ``data`` as ``{stem}.json``, the table ``lines`` as
    ``{stem}.md``, also printed."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
