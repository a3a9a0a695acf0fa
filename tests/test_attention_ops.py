"""The attention backward as products of the scores (:mod:`hot_compile.runtime.attention_ops`) against the
flash-attention backward in float64, its elementwise kernel against float64's exponential, and the
tool that times it against the fused kernels (``tools/attention_bench.py``)."""

import pytest
import torch

from hot_compile.passes.attention_precision import FLASH_CPU_BACKWARD
from hot_compile.runtime import attention_ops
from tests import tolerances as tol
from tests import tool_scripts

pytestmark = pytest.mark.usefixtures("cpu_build")  # each test on each CPU class's build

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
        ((1, 2, 251, 16), (1, 2, 1100, 16), 16, attention_ops.CHUNK_BYTES),  # the native kernel's queries in 3 blocks, the last odd
    ],
)
@pytest.mark.parametrize("way", ["native", "stored"])
def test_products_backward_against_float64(query_shape, key_shape, value_dim, chunk_bytes, way, monkeypatch):
    """Both ways: the native kernel on AVX512-BF16, a head at a time, and chunks of heads whose scores
    are stored in float32 from upcast operands, then batched products."""
    monkeypatch.setattr(attention_ops, "CHUNK_BYTES", chunk_bytes)
    if way == "stored":
        monkeypatch.setattr(attention_ops, "bf16_attention_backward", lambda: False)
    elif not attention_ops.bf16_attention_backward():
        pytest.skip("the native attention backward needs AVX512-BF16")
    else:
        monkeypatch.setattr(attention_ops, "_scores", _not_called)
    grad, q, k, v, out, lse = _operands(query_shape, key_shape, value_dim, torch.Generator().manual_seed(0))
    scale = query_shape[-1] ** -0.5
    grads = attention_ops.attention_backward(grad, q, k, v, out, lse, scale)
    exact = FLASH_CPU_BACKWARD(*(t.double() for t in (grad, q, k, v, out, lse)), 0.0, False)
    kernel = FLASH_CPU_BACKWARD(grad, q, k, v, out, lse, 0.0, False)
    for got, want, fused in zip(grads, exact, kernel):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape and got.stride() == fused.stride()
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error <= tol.ATTENTION_PRODUCTS, error


@pytest.fixture
def threads():
    """Runs the test body under each thread count it asks for, then restores torch's own."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(1, 1, 300, 16), (1, 3, 130, 16)])
def test_native_backward_shares_few_heads_among_threads(shape, threads):
    """With fewer heads than threads, the native kernel splits a head's query blocks among threads, each
    summing its blocks' dK and dV, added in block order after all. Against float64 under 1 to 3 threads;
    dQ's rows are whole in each block, so it is the same under any."""
    if not attention_ops.bf16_attention_backward():
        pytest.skip("the native attention backward needs AVX512-BF16")
    grad, q, k, v, out, lse = _operands(shape, shape, shape[-1], torch.Generator().manual_seed(2))
    exact = FLASH_CPU_BACKWARD(*(t.double() for t in (grad, q, k, v, out, lse)), 0.0, False)
    query_grads = []
    for count in (1, 2, 3):
        threads(count)
        grads = attention_ops.attention_backward(grad, q, k, v, out, lse, shape[-1] ** -0.5)
        for got, want in zip(grads, exact):
            assert ((got.double() - want).norm() / want.norm()).item() <= tol.ATTENTION_PRODUCTS
        query_grads.append(grads[0])
    assert all(torch.equal(dq, query_grads[0]) for dq in query_grads)


def _not_called(*args):
    raise AssertionError("the stored score products ran where the native kernel should")


def test_native_scores_against_float64():
    """The native kernel's ``P`` and ``dS`` against float64, read out exactly through two of its products:
    with ``dO``'s rows one-hot, ``dV = Pᵀ dO`` holds ``Pᵀ``, and with ``Q``'s rows twice one-hot, ``dK = dSᵀ Q``
    holds ``2·dSᵀ`` (one term in each sum, bf16 values: no rounding). ``P`` within one bf16 rounding, the
    float32 exponential's error and the float32 sum's bound on its exponent (``scale·Q·Kᵀ``); ``dS`` within
    one bf16 rounding plus ``P·scale`` times its difference's error (``dS`` is a difference of nearly equal
    terms). Tiles of 12 rows and 32 columns left partial (a last tile of one row, and of a whole vector and
    a part of one), an odd number of keys and queries (the last pair of each contraction half padding);
    q and k in the flash kernels' layout, dO contiguous."""
    if not attention_ops.bf16_attention_backward():
        pytest.skip("the native attention backward needs AVX512-BF16")
    gen = torch.Generator().manual_seed(3)
    b, h, l, s, e = 2, 3, 37, 53, 64
    one_hot = torch.eye(l, e).expand(b, h, l, e)
    q = (2 * one_hot).bfloat16().transpose(1, 2).contiguous().transpose(1, 2)
    k, v = (torch.randn(b, s, h, e, generator=gen).bfloat16().transpose(1, 2) for _ in range(2))
    g = one_hot.bfloat16().contiguous()
    out = torch.randn(b, h, l, e, generator=gen).bfloat16()
    scale = e**-0.5
    scores = scale * q.double() @ k.double().transpose(-1, -2)
    lse = torch.logsumexp(scores, -1).float()
    _, dk, dv = attention_ops.attention_backward(g, q, k, v, out, lse, scale)
    p, ds = dv[..., :l].transpose(-1, -2), dk[..., :l].transpose(-1, -2) / 2
    exact_p = (scores - lse.double()[..., None]).exp()
    delta = (g.double() * out.double()).sum(-1)
    difference = g.double() @ v.double().transpose(-1, -2) - delta[..., None]
    exact_ds = exact_p * scale * difference
    exponent_bound = scale * e * tol.FLOAT32_SUM_PER_TERM * (q.double().abs() @ k.double().abs().transpose(-1, -2))
    assert p.dtype == ds.dtype == torch.bfloat16 and p.shape == (b, h, l, s)
    p_bound = (tol.BF16_ROUNDING + (1 + tol.BF16_ROUNDING) * (tol.FLOAT32_EXP + 2 * exponent_bound)) * exact_p
    assert ((p.double() - exact_p).abs() <= p_bound).all()
    # dO·Vᵀ and Δ are one term each here, exact in float32: dS's error is P's, and its rounding.
    ds_bound = tol.BF16_ROUNDING * exact_ds.abs() + (1 + tol.BF16_ROUNDING) * p_bound * scale * difference.abs()
    assert ((ds.double() - exact_ds).abs() <= ds_bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_dots_against_float64(dtype):
    """``Δ = rowsum(dO ∘ O)`` of operands in the flash kernels' layout, within the float32 sum's bound."""
    gen = torch.Generator().manual_seed(5)
    g, o = (torch.randn(2, 9, 3, 40, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    delta = attention_ops.row_dots(g, o)
    products = g.double() * o.double()
    bound = 40 * tol.FLOAT32_SUM_PER_TERM * products.abs().sum(-1)
    assert delta.dtype == torch.float32 and delta.shape == (2, 3, 9)
    assert ((delta.double() - products.sum(-1)).abs() <= bound).all()


def test_products_backward_fake_matches_its_kernel():
    operands = _operands((2, 2, 24, 16), (2, 2, 24, 16), 16, torch.Generator().manual_seed(1))
    torch.library.opcheck(attention_ops.attention_backward, (*operands, 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_probabilities_and_score_grad_against_float64(dtype):
    gen = torch.Generator().manual_seed(0)
    shifted = -8 * torch.rand(1000, generator=gen)  # log-probabilities within float16's normal range; 1000: a partial last vector
    score_grad = torch.randn(1000, generator=gen)
    p, ds = attention_ops.attention_probabilities(shifted, score_grad, dtype)
    exact = shifted.double().exp()
    bound = tol.FLOAT32_EXP if dtype == torch.float32 else tol.BF16_ROUNDING
    assert p.dtype == ds.dtype == dtype
    assert ((p.double() - exact).abs() / exact).max() <= bound
    representable = (exact * score_grad.double()).abs() > 1e-4  # float16's subnormals lose the rest
    assert ((ds.double() - exact * score_grad.double()).abs() / (exact * score_grad.double()).abs())[representable].max() <= bound


def test_probabilities_clamp_below_the_normal_range():
    p, _ = attention_ops.attention_probabilities(torch.tensor([-1000.0, -87.0, float("-inf")]), torch.ones(3), torch.float32)
    assert torch.equal(p, torch.full((3,), torch.tensor(-87.0).exp().item()))


def test_attention_bench_times_and_checks_the_three_ways(monkeypatch):
    bench = tool_scripts.load("attention_bench")
    monkeypatch.setattr(bench, "SHAPES", ((2, 2, 24, 16),))
    (row,) = bench.measure(repeats=1)
    assert row["work"] == 2 * 2 * 24 * 24 * 16
    assert all(row[f"{way} ms"] > 0 for way in ("bf16 kernel", "float32 kernel", "products"))
    assert row["products error"] <= tol.ATTENTION_PRODUCTS and row["float32 kernel error"] <= row["bf16 kernel error"] + tol.BF16_ROUNDING


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_probabilities_keep_nan(dtype):
    """A NaN score stays NaN in ``P`` and ``dS``, in whole vectors and in a partial last one."""
    shifted = torch.zeros(40)
    shifted[[3, 37]] = float("nan")
    p, ds = attention_ops.attention_probabilities(shifted, torch.ones(40), dtype)
    for out in (p, ds):
        assert out.isnan().nonzero().flatten().tolist() == [3, 37]
