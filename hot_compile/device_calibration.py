"""``hot-compile calibrate-device``: this machine's rates for the cost model, measured by
micro-benchmarks and cached where :func:`hot_compile.runtime.devices.load_calibrated` finds them."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable

import torch

from .config import HotConfig
from .passes.attention_precision import FLASH_CPU_BACKWARD
from .passes.cost_model import SiteCost, forward_cost, grad_input_cost, grad_weight_cost
from .passes.cost_model import attention_flops as attention_flops_of
from .passes.numerics import resolve_numerics
from .runtime import cpu_gemm, cpu_kernels
from .runtime.attention_ops import attention_backward
from .runtime.devices import DTYPES, DeviceProfile, cpu_identity
from .runtime.hadamard import padded_length
from .runtime.int8_gemm import int8_gemm_kind, int8_matmul, u8s8_linear, u8s8_operand
from .runtime.ops import hq_grad_input


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``, after one call that is not timed."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# The HQ ops the transform rate is fitted on: a square layer in float32, and a transformer's
# projections (ViT-S/16 at batch 32: 6272 tokens, 384 wide, MLP 1536) in bfloat16, as autocast runs them.
FIT_SITES = ((2048, 1024, 1024, torch.float32), (6272, 384, 1536, torch.bfloat16), (6272, 1536, 384, torch.bfloat16))


def _fitted_transform_rate(profile: DeviceProfile, repeats: int, sites=FIT_SITES) -> float:
    """``T`` such that the cost model's HQ estimates fit the measured times of HQ's grad_input op at
    ``sites`` (``(L, N, K, dtype)``), with the default numerics: the transforms, scales, hash and
    quantizers the backend runs, on the kernels it runs them with, rather than one stand-alone loop.

    Each estimate is ``rest + outputs / T``; ``1/T`` is the least-squares slope through the origin of
    the measured time left after ``rest`` against ``outputs``: ``Σ outputs·left / Σ outputs²``."""
    bits = profile.widest_bits_at_narrowest_rate()
    without_transforms = dataclasses.replace(profile, transform_rate=float("inf"))
    numerator = denominator = 0.0
    for l, n, k, dtype in sites:
        g, w, seed = torch.randn(l, n, dtype=dtype), torch.randn(n, k, dtype=dtype), torch.tensor(0)
        measured = median_seconds(lambda: hq_grad_input(g, w, seed, bits, bits, True, True, "per_channel"), repeats)
        padded = padded_length(n)
        outputs = l * padded + padded * k
        rest = grad_input_cost(l, n, k, w.element_size(), profile.matmul_rate(dtype), without_transforms, bits).hot_s
        # The other terms can exceed a measurement that is mostly transform-bound by noise alone.
        left = max(measured - rest, measured / 4)
        numerator += outputs * left
        denominator += outputs * outputs
    return denominator / numerator


# The value a derivative code is measured on: a ViT-S/16 MLP's hidden activation at batch 32, in bf16.
# The code of a given value: its rounding alone (the evaluation of a derivative the encoder computes
# moves out of the backward, and is charged on neither side).
CODE_SHAPE = (6272, 1536)


def _stochastic_code_rate(profile: DeviceProfile, repeats: int, shape=CODE_SHAPE) -> float:
    """``S``: the values/s that the CPU's derivative code (``cpu_kernels.encode_derivative``) rounds,
    from its measured time less what :func:`~hot_compile.passes.cost_model.saved_compression_cost`
    charges it apart from the rounding: the value's read ``numel·2 / R``, the codes' write and one call."""
    value = torch.rand(shape).bfloat16()
    numel = value.numel()
    measured = median_seconds(lambda: cpu_kernels.encode_derivative(value, 0), repeats)
    rest = numel * value.element_size() / profile.read_bw + profile.write_seconds(numel // 2) + profile.kernel_overhead
    # As for the transform rate: noise alone can bring the other terms near a measurement.
    return numel / max(measured - rest, measured / 4)


def layer_site_costs(l: int, n: int, k: int, profile: DeviceProfile) -> dict[str, SiteCost]:
    """The cost model's estimates of the sites of one float32 ``Linear(k, n)`` on ``[l, k]``, at the
    default numerics resolved for ``profile``: its forward (where ``forward_bits`` rewrites it),
    grad_input and grad_weight."""
    flops = profile.matmul_rate(torch.float32)
    config = resolve_numerics(HotConfig(), profile)
    sites = {
        "gx": grad_input_cost(l, n, k, 4, flops, profile, config.gx_bits),
        "gw": grad_weight_cost(l, n, k, config.rank, 4, flops, profile, config.gw_bits),
    }
    if config.forward_bits is not None:
        sites["fwd"] = forward_cost(l, n, k, 4, flops, profile, config.forward_bits)
    return sites


def _step_seconds(compiled, x, grad, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        x.grad = None
        start = time.perf_counter()
        compiled(x).backward(grad)
        samples.append(time.perf_counter() - start)
    return samples


def layer_step_seconds(l: int, n: int, k: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a training step of ``Linear(k, n)`` on ``[l, k]`` compiled by Inductor and by
    HOT with every site rewritten: (inductor, hot), the variants interleaved so that machine noise
    hits both alike."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(k, n)
    x = torch.randn(l, k, requires_grad=True)
    grad = torch.randn(l, n)
    variants = {
        "inductor": torch.compile(layer, backend="inductor"),
        "hot": torch.compile(layer, backend="hot", options={"policy": "hot", "strict": True}),
    }
    for compiled in variants.values():
        _step_seconds(compiled, x, grad, 2)  # compile and warm up
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, compiled in variants.items():
            samples[name] += _step_seconds(compiled, x, grad, 1)
    torch._dynamo.reset()
    return statistics.median(samples["inductor"]), statistics.median(samples["hot"])


# Small layers (L, N, K) whose training step prices an op's fixed cost: at these sizes it is most of
# the difference between the two variants.
OVERHEAD_LAYERS = ((512, 64, 64), (512, 256, 256), (2048, 64, 64))


def _fitted_op_overhead(profile: DeviceProfile, repeats: int, layers=OVERHEAD_LAYERS) -> float:
    """``o`` such that the cost model's step estimates fit measured training steps of ``layers``.

    Per layer, the residual is the measured difference (HOT − Inductor) less the estimated one at
    ``o = 0``; ``o`` is the least-squares slope through the origin of the residuals against the number
    of HOT ops in the layer's step, as many as the cost model charges ``o`` for: ``Σ ops·residual /
    Σ ops²``, and at least 0."""
    without, per_op = (dataclasses.replace(profile, op_overhead=o) for o in (0.0, 1.0))
    numerator = denominator = 0.0
    for l, n, k in layers:
        sites = layer_site_costs(l, n, k, without)
        inductor, hot = layer_step_seconds(l, n, k, repeats)
        residual = hot - inductor - sum(c.hot_s - c.original_s for c in sites.values())
        charged = layer_site_costs(l, n, k, per_op)
        ops = round(sum(charged[path].hot_s - sites[path].hot_s for path in sites))
        numerator += ops * residual
        denominator += ops * ops
    return max(numerator / denominator, 0.0)


# ViT-S's attention heads at batch 8.
ATTENTION_SHAPE = (8, 6, 197, 64)


def _attention_seconds(dtype: torch.dtype, repeats: int):
    """Seconds of the flash-attention forward and backward at :data:`ATTENTION_SHAPE` in ``dtype``, and
    the backward's operands ``(grad, q, k, v, out, lse)``."""
    q, k, v = (torch.randn(ATTENTION_SHAPE, dtype=dtype) for _ in range(3))
    forward = lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
    out, lse = forward()[:2]
    grad = torch.randn_like(out)
    backward = median_seconds(lambda: FLASH_CPU_BACKWARD(grad, q, k, v, out, lse, 0.0, False), repeats)
    return median_seconds(forward, repeats), backward, (grad, q, k, v, out, lse)


def _own_gemm_ops(q: torch.Tensor, q_max: int, repeats: int) -> float:
    """OP/s of the GEMM HOT's CPU ops run on codes like ``q`` (``[size, size]``, ``|q| ≤ q_max``), on a
    contraction long enough that its output write is noise. ``int8_matmul`` is the path's own product
    wherever the dispatch leaves a shape to it."""
    size = q.shape[0]
    a, b, ones = q.repeat(1, 4), q.repeat(4, 1), torch.ones(size)
    product = functools.partial(int8_matmul, a_max=q_max, b_max=q_max)
    return 8 * size**3 / median_seconds(lambda: cpu_gemm.matmul_dequantized(a, b, ones, ones, 1.0, torch.float32, product, b_max=q_max), repeats)


def calibrate_device(size: int = 1024, repeats: int = 15) -> DeviceProfile:
    """Measure this CPU: float and integer matmul rates (INT8 and INT4 operands), streaming
    bandwidths, the per-call overhead, the fused attention's rate per dtype and which way runs its
    half-precision backward fastest (bf16 or float32 kernel, or products of the scores), the
    transform + quantize rate fitted to the compiled HQ op
    (see :func:`_fitted_transform_rate`), the derivative code's rounding rate
    (:func:`_stochastic_code_rate`), then the per-op overhead fitted to training steps of small
    layers (:func:`_fitted_op_overhead`)."""
    flops = {}
    for dtype in DTYPES:
        a = torch.randn(size, size).to(getattr(torch, dtype))
        flops[dtype] = 2 * size**3 / median_seconds(lambda a=a: a @ a, repeats)
    q8 = torch.randint(-127, 128, (size, size), dtype=torch.int8)
    fused_epilogue = bool(cpu_gemm.gemm_engine())
    if fused_epilogue:
        int8_ops = _own_gemm_ops(q8, 127, repeats)
    else:
        int8_ops = 2 * size**3 / median_seconds(lambda: int8_matmul(q8, q8, 127, 127), repeats)
    narrow_int8_ops = None
    q4 = torch.randint(-7, 8, (size, size), dtype=torch.int8)
    if cpu_gemm.gemm_engine(7) == "avx2":  # narrow operands run HOT's AVX2 GEMM, wider ones int8_matmul
        narrow_int8_ops = _own_gemm_ops(q4, 7, repeats)
    elif int8_gemm_kind(torch.device("cpu")) == "u8s8":
        # The GEMM alone: a compiled op's quantizer writes the shifted uint8 operand itself.
        (shifted, zero_point), weight = u8s8_operand(q4, 7), q4.t().contiguous()
        narrow_int8_ops = 2 * size**3 / median_seconds(lambda: u8s8_linear(shifted, zero_point, weight), repeats)

    big = torch.randn(4096, 4096)
    read_bw = big.numel() * 4 / median_seconds(lambda: big.sum(), repeats)
    # A new 16 MiB output, which the heap reuses; a 64 MiB one is above the mmap threshold, a fresh
    # mapping each time whose every page faults.
    act = torch.randn(2048, 2048)
    write_bw = act.numel() * 4 / median_seconds(lambda: torch.empty_like(act).fill_(1.0), repeats)
    fresh_write_bw = big.numel() * 4 / median_seconds(lambda: torch.empty_like(big).fill_(1.0), repeats)
    tiny = torch.randn(4, 4)
    kernel_overhead = median_seconds(lambda: tiny.add(1), 50)
    b, h, l, e = ATTENTION_SHAPE
    attention = {dtype: _attention_seconds(dtype, repeats) for dtype in (torch.float32, torch.bfloat16)}
    # The faster direction's rate: DeviceProfile.attention_flops.
    attention_flops = {
        str(dtype).removeprefix("torch."): max(
            attention_flops_of(b, h, l, l, e, e, backward=False, causal=False) / forward,
            attention_flops_of(b, h, l, l, e, e, backward=True, causal=False) / backward,
        )
        for dtype, (forward, backward, _) in attention.items()
    }
    # The bf16 flash-attention backward against float32 with the casts.
    _, bf16_backward, (grad, q, k, v, out, lse) = attention[torch.bfloat16]
    upcast = (grad, q, k, v, out)
    fp32_backward = median_seconds(
        lambda: [g.bfloat16() for g in FLASH_CPU_BACKWARD(*(t.float() for t in upcast), lse, 0.0, False)], repeats
    )
    products_backward = median_seconds(lambda: attention_backward(grad, q, k, v, out, lse, e**-0.5), repeats)
    measured = DeviceProfile(
        name=f"calibrated:{cpu_identity().split('|')[0]}",
        matmul_flops=flops,
        int8_ops=int8_ops,
        read_bw=read_bw,
        write_bw=write_bw,
        fresh_write_bw=fresh_write_bw,
        transform_rate=1.0,  # fitted next, from the rates above
        kernel_overhead=kernel_overhead,
        op_overhead=0.0,  # fitted last, on the other rates
        narrow_int8_ops=narrow_int8_ops,
        fp32_attention_backward=fp32_backward < bf16_backward,
        attention_backward_products=products_backward < min(fp32_backward, bf16_backward),
        int8_fused_epilogue=fused_epilogue,
        attention_flops=attention_flops,
    )
    measured = dataclasses.replace(
        measured,
        transform_rate=_fitted_transform_rate(measured, repeats),
        stochastic_code_rate=_stochastic_code_rate(measured, repeats),
    )
    return dataclasses.replace(measured, op_overhead=_fitted_op_overhead(measured, repeats))
