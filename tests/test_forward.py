"""The integer forward (``HotConfig.forward_bits``): the op against float64, and the rewrite in the pass."""

import copy
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import hot_compile
from hot_compile import HotConfig
from hot_compile.runtime import aten_impl, ops
from tests import reference
from tests import tolerances as tol
from tests.data import make, rel_err
from tests.harness import aot_compile
from tests.models import MLP, Block, grad_errors

L, N, K = 200, 48, 72  # K not a multiple of 16: the transform pads it


class _CpuKernel:
    @staticmethod
    def int8_linear(x, w, bias=None, *, bits=8):
        return ops.int8_linear(x, w, bias, bits)


@pytest.fixture(params=["composite", "cpu_kernel"])
def impl(request):
    return aten_impl if request.param == "composite" else _CpuKernel


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(L,), (4, 50)])
def test_int8_linear_matches_reference_and_the_exact_product(impl, shape, bias):
    x = make("outlier", L, K, 0).reshape(*shape, K)
    w = make("gaussian", N, K, 1) / K**0.5
    b = torch.randn(N) if bias else None
    out = impl.int8_linear(x, w, b)
    assert out.shape == (*shape, N) and out.dtype == x.dtype
    assert rel_err(out, reference.int8_linear(x, w, b)) < tol.FP32_VS_REFERENCE
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert rel_err(out, exact) < tol.INT8_PER_SLICE_PRODUCT


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear_in_half_precision(impl, dtype):
    x, w, b = make("gaussian", L, K, 0).to(dtype), make("gaussian", N, K, 1).to(dtype), torch.randn(N, dtype=dtype)
    out = impl.int8_linear(x, w, b)
    assert out.dtype == dtype
    assert rel_err(out, x.double() @ w.double().T + b.double()) < tol.HQ_HALF_PRECISION


def test_int8_linear_of_zeros_and_non_finite_inputs(impl):
    w = make("gaussian", N, K, 1)
    assert torch.equal(impl.int8_linear(torch.zeros(L, K), w), torch.zeros(L, N))
    x = make("gaussian", L, K, 0)
    x[7, 3] = float("nan")
    out = impl.int8_linear(x, w)
    assert not torch.isfinite(out[7]).any() and torch.isfinite(out[8]).all()


def test_int8_linear_passes_opcheck():
    x, w = make("gaussian", L, K, 0), make("gaussian", N, K, 1)
    torch.library.opcheck(ops.int8_linear, (x, w, torch.randn(N), 8))
    torch.library.opcheck(ops.int8_linear, (x, w, None, 6))


def _forward_rows(config):
    compiled, graphs = aot_compile(MLP(32, 64, 32), config)
    x = torch.randn(2, 40, 32)
    out = compiled(x)
    out.sum().backward()
    return graphs, hot_compile.last_report()


def test_forward_bits_none_leaves_the_forward_exact():
    graphs, report = _forward_rows(HotConfig(policy="hot", strict=True, forward_bits=None))
    assert report.select(path="fwd") == []
    assert not any(n.target is torch.ops.hot_compile.int8_linear.default for n in graphs.forward.graph.nodes)
    assert report.select(path="gx", decision="HQ") and report.select(path="gw", decision="HLA+ABC")


@pytest.mark.parametrize("forward_bits", ["auto", 8])
def test_forward_bits_rewrites_every_forward_product(forward_bits):
    graphs, report = _forward_rows(HotConfig(policy="hot", strict=True, forward_bits=forward_bits))
    rows = report.select(path="fwd")
    assert [r.decision for r in rows] == ["HQ", "HQ"] and all("x per_token, W per_channel" in r.numerics for r in rows)
    ops_in_forward = [n for n in graphs.forward.graph.nodes if n.target is torch.ops.hot_compile.int8_linear.default]
    assert len(ops_in_forward) == 2
    assert all(n.meta["hot_compile"]["path"] == "fwd" for n in ops_in_forward)
    assert not any(n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default) for n in graphs.forward.graph.nodes)


def test_forward_bits_through_inductor_matches_the_exact_model():
    """A transformer block with integer forward and backward products: the output and every gradient
    within their INT8 bounds against float64, and the report says the forwards were rewritten."""
    torch.manual_seed(0)
    model = Block(32, 4)
    x = torch.randn(2, 48, 32)
    options = {"policy": "hot", "strict": True, "forward_bits": 8}
    compiled = torch.compile(model, backend="hot", options=options)
    exact = copy.deepcopy(model).double()(x.double())
    assert rel_err(compiled(x), exact) < tol.E2E_GRAD
    assert len(hot_compile.last_report().select(path="fwd", decision="HQ")) == 4  # qkv, proj, fc1, fc2
    errors = grad_errors(model, compiled, x)
    assert errors and max(errors.values()) < tol.E2E_GRAD_INT8_FORWARD, errors


def test_a_value_two_hot_ops_read_is_computed_once():
    """fc2's input (GELU's output, a view of a pointwise value) is read by ABC's compression and by
    the integer forward: Inductor writes it into one buffer, which both extern calls read."""
    model = MLP(32, 64)
    compiled = torch.compile(model, backend="hot", options={"policy": "hot", "strict": True, "forward_bits": 8})
    _, (forward_code, *_) = run_and_get_code(compiled, torch.randn(4, 48, 32))
    report = hot_compile.last_report()
    assert len(report.select(path="fwd", decision="HQ")) == len(report.select(path="gw", decision="HLA+ABC")) == 2
    read = {
        op: re.findall(rf"torch\.ops\.hot_compile\.{op}\.default\((\w+|reinterpret_tensor\(\w+)", forward_code)
        for op in ("compress_activation", "int8_linear")
    }
    assert len(read["compress_activation"]) == len(read["int8_linear"]) == 2, read
    assert read["compress_activation"][1] == read["int8_linear"][1], read


def test_forward_bits_is_validated():
    with pytest.raises(ValueError, match="forward_bits"):
        HotConfig(forward_bits=9)
    with pytest.raises(ValueError, match="forward_bits"):
        HotConfig(forward_bits="8")


@pytest.mark.parametrize("bits", [7, 8])
def test_int8_linear_on_each_integer_gemm(int8_path, bits):
    """The CPU kernel on every GEMM a CPU may have: the uint8 × int8 one (AVX2, where "auto" gives
    7 bits), torch._int_mm (VNNI, AMX) and the exact float product."""
    x, w, b = make("gaussian", L, K, 0), make("gaussian", N, K, 1), torch.randn(N)
    out = ops.int8_linear(x, w, b, bits)
    assert rel_err(out, reference.int8_linear(x, w, b, bits=bits)) < tol.FP32_VS_REFERENCE
