"""The attention backward as batched products (:mod:`hot_compile.runtime.attention_ops`) against the
flash-attention backward in float64, its elementwise kernel against float64's exponential, and the
tool that times it against the fused kernels (``tools/attention_bench.py``)."""

import pytest
import torch

from hot_compile.passes.attention_precision import FLASH_CPU_BACKWARD
from hot_compile.runtime import attention_ops, cpu_kernels
from tests import tolerances as tol
from tests import tool_scripts

FLASH_CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _operands(query_shape, key_shape, value_dim, gen):
    q = torch.randn(query_shape, generator=gen).bfloat16()
    k = torch.randn(key_shape, generator=gen).bfloat16()
    v = torch.randn(*key_shape[:-1], value_dim, generator=gen).bfloat16()
    out, lse = FLASH_CPU_FORWARD(q, k, v, 0.0, False)[:2]
    return torch.randn(out.shape, generator=gen).bfloat16(), q, k, v, out, lse


@pytest.mark.parametrize(
    "query_shape, key_shape, value_dim, chunk_bytes",
    [
        ((4, 3, 40, 16), (4, 3, 40, 16), 16, 4 * 40 * 40 * 3 * 2),  # two batch entries a chunk
        ((2, 2, 7, 16), (2, 2, 9, 16), 16, attention_ops.CHUNK_BYTES),  # cross attention
        ((1, 4, 300, 32), (1, 4, 300, 32), 32, 4 * 300 * 300 * 3),  # three heads of one entry a chunk
    ],
)
def test_products_backward_against_float64(query_shape, key_shape, value_dim, chunk_bytes, monkeypatch):
    monkeypatch.setattr(attention_ops, "CHUNK_BYTES", chunk_bytes)
    grad, q, k, v, out, lse = _operands(query_shape, key_shape, value_dim, torch.Generator().manual_seed(0))
    scale = query_shape[-1] ** -0.5
    grads = attention_ops.attention_backward(grad, q, k, v, out, lse, scale)
    exact = FLASH_CPU_BACKWARD(*(t.double() for t in (grad, q, k, v, out, lse)), 0.0, False)
    kernel = FLASH_CPU_BACKWARD(grad, q, k, v, out, lse, 0.0, False)
    for got, want, fused in zip(grads, exact, kernel):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape and got.stride() == fused.stride()
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error <= tol.ATTENTION_PRODUCTS, error


def test_products_backward_fake_matches_its_kernel():
    operands = _operands((2, 2, 24, 16), (2, 2, 24, 16), 16, torch.Generator().manual_seed(1))
    torch.library.opcheck(attention_ops.attention_backward, (*operands, 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_probabilities_and_score_grad_against_float64(dtype):
    gen = torch.Generator().manual_seed(0)
    shifted = -8 * torch.rand(1000, generator=gen)  # log-probabilities within float16's normal range; 1000: a partial last vector
    score_grad = torch.randn(1000, generator=gen)
    p, ds = cpu_kernels.attention_probabilities(shifted, score_grad, dtype)
    exact = shifted.double().exp()
    bound = tol.FLOAT32_EXP if dtype == torch.float32 else tol.BF16_ROUNDING
    assert p.dtype == ds.dtype == dtype
    assert ((p.double() - exact).abs() / exact).max() <= bound
    representable = (exact * score_grad.double()).abs() > 1e-4  # float16's subnormals lose the rest
    assert ((ds.double() - exact * score_grad.double()).abs() / (exact * score_grad.double()).abs())[representable].max() <= bound


def test_probabilities_clamp_below_the_normal_range():
    p, _ = cpu_kernels.attention_probabilities(torch.tensor([-1000.0, -87.0, float("-inf")]), torch.ones(3), torch.float32)
    assert torch.equal(p, torch.full((3,), torch.tensor(-87.0).exp().item()))


def test_attention_bench_times_and_checks_the_three_ways(monkeypatch):
    bench = tool_scripts.load("attention_bench")
    monkeypatch.setattr(bench, "SHAPES", ((2, 2, 24, 16),))
    (row,) = bench.measure(repeats=1)
    assert row["work"] == 2 * 2 * 24 * 24 * 16
    assert all(row[f"{way} ms"] > 0 for way in ("bf16 kernel", "float32 kernel", "products"))
    assert row["products error"] <= tol.ATTENTION_PRODUCTS and row["float32 kernel error"] <= row["bf16 kernel error"] + tol.BF16_ROUNDING
