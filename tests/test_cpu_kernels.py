"""The fused CPU loops of :mod:`hot_compile.runtime.cpu_kernels` against the aten quantizers and transforms they
replace. The ops built on them are checked against float64 in ``test_ops.py`` (fixture ``impl``)."""

import math
import os
import pathlib

import pytest
import torch

from hot_compile import HotConfig
from hot_compile.runtime import aten_impl, cpu_gemm, cpu_kernels, hadamard, int8_gemm, ops, quant
from tests import tolerances as tol
from tests.data import make, rel_err
from tests.harness import aot_compile
from tests.models import MLP

pytestmark = pytest.mark.usefixtures("cpu_build")  # each test on each CPU class's build

SEED = torch.tensor(5)


def _levels_agree(q: torch.Tensor, expected: torch.Tensor) -> bool:
    """The same integer levels up to ties at a rounding boundary, each at most one level off."""
    differ = q.int() != expected.int()
    return differ.float().mean() <= tol.LEVEL_MISMATCH_FRACTION and (q.int() - expected.int()).abs().max() <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_quantize_rows_is_the_stochastic_quantizer_of_the_block_hadamard(dtype, per_row, bits, layout):
    g = make("lognormal", 97, 72, 0).to(dtype)  # 72 = 4.5 blocks
    if layout == "column-major":
        g = g.t().contiguous().t()
    width = hadamard.padded_length(72)
    offset = quant.noise_offset(SEED, aten_impl.SALT_GRAD_INPUT)
    q, scale = cpu_kernels.quantize_rows(g, bits, width=width, hadamard=True, per_row=per_row, offset=offset)
    dim = -1 if per_row else None
    expected_q, expected_scale = quant.quantize_stochastic(
        hadamard.block_hadamard(g.float(), 1), bits, SEED, dim=dim, salt=aten_impl.SALT_GRAD_INPUT
    )
    assert q.shape == (97, width) and scale.shape == expected_scale.shape
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    assert _levels_agree(q, expected_q)


@pytest.mark.parametrize("rank", [1, 8, 16])
@pytest.mark.parametrize("tokens", [96, 197])
def test_quantize_columns_is_the_quantizer_of_the_lowpass(rank, tokens):
    x = make("outlier", tokens, 40, 1)
    tail = hadamard.tail_basis(tokens % 16, rank)
    rows = hadamard.lowpass_rows(tokens, rank)
    projected = hadamard.lowpass(x, rank, tail)
    amax, abs_sum, square_sum = cpu_kernels.column_moments(x, hadamard.walsh_basis(rank), tail, rows)
    assert torch.equal(cpu_kernels.column_amax(x, hadamard.walsh_basis(rank), tail, rows), amax)
    torch.testing.assert_close(amax, projected.abs().amax(0), rtol=1e-6, atol=0)
    torch.testing.assert_close(abs_sum, projected.abs().sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(square_sum, (projected * projected).sum(0), rtol=1e-5, atol=1e-5)
    for stochastic in (True, False):
        expected_q, scale = (
            quant.quantize_stochastic(projected, 8, SEED, dim=0, salt=3)
            if stochastic
            else quant.quantize_nearest(projected, 8, dim=0)
        )
        offset = quant.noise_offset(SEED, 3)
        q = cpu_kernels.quantize_columns(
            x, hadamard.walsh_basis(rank), tail, rows, 8, scale.flatten(), stochastic=stochastic, offset=offset
        )
        assert q.shape == (rows, 40) and _levels_agree(q, expected_q)


@pytest.mark.parametrize("rank", [5, 16])
@pytest.mark.parametrize("shape", [(197, 40), (256, 130)])
def test_quantize_columns_column_major_stores_the_same_codes(rank, shape):
    """HLA's ``q(P g)`` stored column-major is the row-major codes exactly: the same noise index per
    value, whole 16 × 64 tiles by byte transposes (rank 16, 64 columns), the rest value by value."""
    tokens, channels = shape
    x = make("outlier", tokens, channels, 2)
    tail = hadamard.tail_basis(tokens % 16, rank)
    rows = hadamard.lowpass_rows(tokens, rank)
    scale = hadamard.lowpass(x, rank, tail).abs().amax(0) / 127
    args = (x, hadamard.walsh_basis(rank), tail, rows, 8, scale)
    expected = cpu_kernels.quantize_columns(*args, stochastic=True, offset=5)
    q = cpu_kernels.quantize_columns(*args, stochastic=True, offset=5, column_major=True)
    assert q.stride() == (1, rows) and torch.equal(q, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["gaussian", "lognormal", "outlier"])
def test_encode_rows_is_the_reference_within_half_a_level_of_float64(dtype, kind):
    x = make(kind, 64, 90, 0).to(dtype).view(4, 16, 90)  # 90 = 5 whole vectors and a tail of 10
    q, scale = cpu_kernels.encode_rows(x, 8)
    expected_q, expected_scale = aten_impl.encode_rows(x, bits=8)
    assert q.shape == x.shape and scale.shape == (4, 16, 1)
    assert torch.equal(scale, expected_scale) and torch.equal(q, expected_q)  # the same division and rounding
    exact = x.double()
    error = (quant.dequantize(q, scale).double() - exact).abs()
    assert (error <= exact.abs().amax(-1, keepdim=True) * (tol.HALF_INT8_LEVEL + tol.FP32_ROUNDINGS)).all()


def _qkv_heads(dtype):
    """q of a fused qkv output [2, 20, 3·4·32], as attention reads it: [2, 4, 20, 32], rows 32 apart
    within a token and 384 apart across tokens."""
    qkv = make("gaussian", 40, 384, 0).to(dtype).view(2, 20, 3, 4, 32)
    return qkv.permute(2, 0, 3, 1, 4)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "layout, in_place",
    [
        ("heads of a fused qkv", True),  # three strides of rows
        ("tokens of those heads", True),  # the same rows in memory order: two strides
        ("a column slice", True),  # one stride of rows, wider than a row
        ("a transposed matrix", False),  # a last dimension that is not contiguous: copied
    ],
)
def test_encode_rows_reads_any_layout_as_the_reference(dtype, layout, in_place):
    heads = _qkv_heads(dtype)
    x = {
        "heads of a fused qkv": heads,
        "tokens of those heads": heads.transpose(1, 2),
        "a column slice": make("gaussian", 50, 96, 1).to(dtype)[:, 16:80],
        "a transposed matrix": make("gaussian", 50, 96, 1).to(dtype).t(),
    }[layout]
    q, scale = cpu_kernels.encode_rows(x, 8)
    expected_q, expected_scale = aten_impl.encode_rows(x.contiguous(), bits=8)
    assert torch.equal(scale, expected_scale) and torch.equal(q, expected_q)
    assert (cpu_kernels._row_groups(x)[0] is x) == in_place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_derivative_code_is_the_reference_and_unbiased(dtype):
    f = (make("gaussian", 8, 90, 0) * 3).sigmoid().to(dtype)  # a derivative-like range; rows of 90 start on and off a multiple of 32 noise indices
    f[:, :4] = 0
    exact = f.double()
    draws = []
    for s in range(tol.SR_DRAWS):
        seed = torch.tensor(s)
        packed, lo, step = cpu_kernels.encode_derivative(f, quant.noise_offset(seed, aten_impl.SALT_DERIVATIVE))
        if s < 4:
            expected = aten_impl.encode_derivative(f, seed, bits=4)
            assert all(torch.equal(a, b) for a, b in zip((packed, lo, step), expected))
        decoded = (lo + quant.unpack_nibbles(packed).float() * step).double()
        assert ((decoded - exact).abs() < step.double() * (1 + tol.FP32_ROUNDINGS)).all() and (decoded[:, :4] == 0).all()
        draws.append(decoded)
    assert rel_err(torch.stack(draws).mean(0), exact) < tol.SR_MEAN


@pytest.mark.parametrize("function", sorted(aten_impl.DERIVATIVES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_encoders_derivative_is_within_its_evaluation_error_of_float64(function, dtype):
    """The derivative the encoder codes (``cpu_kernels.derivative``) against float64, on a dense grid
    over both GELU saturations, signed zeros, denormals, where e^(−x²/2) underflows (|x| ≈ 13.2), and
    at 10³⁰ and 3·10³⁸, where x² overflows float32 and the derivative is 1 or 0; a NaN stays NaN."""
    grid = torch.linspace(-14, 14, 200_001, dtype=torch.float64)
    edges = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 13.2, -13.2, 13.25, -13.25, 1e30, -1e30, 3e38, -3e38], dtype=torch.float64)
    x = torch.cat([grid, edges]).to(dtype)
    exact = aten_impl.DERIVATIVES[function](x.double())
    exact = torch.where(x.double().abs() > 1e20, (x > 0).double(), exact)  # the float64 formula's 0·∞ there
    error = (cpu_kernels.derivative(x, function).double() - exact).abs()
    print(f"{function} {dtype}: max error {error.max():.3g} at x = {x[error.argmax()].item():.6g}")
    assert error.max() <= tol.DERIVATIVE_EVALUATION
    assert cpu_kernels.derivative(torch.tensor([float("nan")]), function).isnan().all()


@pytest.mark.parametrize("function", sorted(aten_impl.DERIVATIVES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_derivative_computed_by_the_encoder_is_the_reference_and_unbiased(function, dtype):
    """The code of a derivative the encoder computes: the reference's (which evaluates the derivative
    with torch, in float32) up to the evaluation's error, so the rows' ``lo`` and ``step`` agree within
    it and a code differs, by one level, only where its value lies within it of a level's threshold
    (1% of codes bounds that; another noise would change half of them); each decoded value within
    one step of the float64 derivative, and the mean of many draws converging to it. Rows of 90 start on and off a multiple of 32 noise indices; the inputs
    reach ±100, where the derivative saturates."""
    x = (make("gaussian", 8, 90, 0) * 4).to(dtype)
    x[:, :2] = torch.tensor([-100.0, 100.0]).to(dtype)
    exact = aten_impl.DERIVATIVES[function](x.double())
    draws = []
    for s in range(tol.SR_DRAWS):
        seed = torch.tensor(s)
        packed, lo, step = cpu_kernels.encode_derivative(x, quant.noise_offset(seed, aten_impl.SALT_DERIVATIVE), function)
        decoded = (lo + quant.unpack_nibbles(packed).float() * step).double()
        bound = step.double() * (1 + tol.FP32_ROUNDINGS) + tol.DERIVATIVE_EVALUATION
        assert ((decoded - exact).abs() < bound).all(), ((decoded - exact).abs() / bound).max()
        if s < 4:
            packed_ref, lo_ref, step_ref = aten_impl.encode_derivative(x, seed, bits=4, function=function)
            # The row's extremes move by at most the evaluation's error: lo and step by that over a step.
            assert ((lo - lo_ref).abs() <= 2 * tol.DERIVATIVE_EVALUATION).all()
            assert ((step - step_ref).abs() <= 2 * tol.DERIVATIVE_EVALUATION / 14).all()
            # A code differs where its value lies within those errors of a level's threshold: rare, by
            # one level (here seed 0's noise at index 0 is exactly 0, under a saturated value on a level).
            levels = quant.unpack_nibbles(packed).int() - quant.unpack_nibbles(packed_ref).int()
            assert levels.abs().max() <= 1 and (levels != 0).sum() <= levels.numel() // 100
        draws.append(decoded)
    assert rel_err(torch.stack(draws).mean(0), exact) < tol.SR_MEAN


@pytest.mark.parametrize("function", sorted(aten_impl.DERIVATIVES))
def test_the_reference_derivatives_are_autograds(function):
    """aten_impl.DERIVATIVES, which the encoder computes and the pass names a backward's function by,
    are the float64 derivatives of the functions they are named after."""
    module = {"gelu": torch.nn.GELU(), "gelu_tanh": torch.nn.GELU(approximate="tanh")}[function]
    x = torch.linspace(-12, 12, 4001, dtype=torch.float64, requires_grad=True)
    module(x).sum().backward()
    assert torch.allclose(aten_impl.DERIVATIVES[function](x.detach()), x.grad, rtol=0, atol=tol.FP64_EXACT)


def test_an_unknown_derivative_is_refused_by_name():
    with pytest.raises(ValueError, match="no derivative 'tanh'"):
        ops.encode_derivative(torch.zeros(3, 4), SEED, 4, "tanh")
    with pytest.raises(ValueError, match="no derivative 'given'"):
        cpu_kernels.derivative(torch.zeros(4), "given")


def test_derivative_code_of_an_odd_row_is_refused():
    with pytest.raises(ValueError, match="odd size 5"):
        cpu_kernels.encode_derivative(torch.zeros(3, 5), 0)


def test_noise_offset_is_the_hash_of_the_seed_and_salt():
    """The same noise as :func:`hot_compile.runtime.quant.hash_uniform`: a quantizer of a tensor of halves
    rounds each element up exactly where its noise is at least one half."""
    v = torch.full((64, 16), 0.5)
    q = cpu_kernels.quantize_columns(
        v, torch.eye(16), None, 64, 8, torch.ones(16), stochastic=True, offset=quant.noise_offset(SEED, 7)
    )
    assert torch.equal(q.bool(), quant.hash_uniform(v, SEED, salt=7) >= 0.5)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matmul_dequantized_scales_each_chunk_with_its_own_rows(monkeypatch, out_dtype):
    monkeypatch.setattr(cpu_gemm, "fused_gemm", lambda: "")
    monkeypatch.setattr(cpu_gemm, "MIN_CHUNK_ROWS", 16)
    monkeypatch.setattr(cpu_gemm, "CHUNK_BYTES", 16 * 4 * 24)  # 16-row chunks of a [.., 24] product
    a = torch.randint(-127, 128, (100, 40), dtype=torch.int8)
    b = torch.randint(-127, 128, (40, 24), dtype=torch.int8)
    row_scale, col_scale = torch.rand(100, 1), torch.rand(1, 24)
    out = cpu_gemm.matmul_dequantized(a, b, row_scale, col_scale, 16, out_dtype, int8_gemm.int8_matmul)
    expected = (a.double() @ b.double()) * row_scale.double() * col_scale.double() / 16
    assert out.dtype == out_dtype
    assert rel_err(out, expected) < {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[out_dtype]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(100, 40, 24), (64, 128, 64), (300, 200, 70), (33, 8, 17), (70, 2100, 40), (40, 8300, 40), (1300, 40, 24)])
def test_fused_product_is_the_chunked_one_exactly(monkeypatch, out_dtype, shape):
    """HOT's own GEMM (AMX, VNNI or AVX2) against the chunked product and dequantize: the int32 sums
    are exact in both and the epilogue's arithmetic is the same, so every output is equal. The shapes
    leave partial tiles along each dimension (32, 12 or 3 rows, 64 contraction values, 32 columns a
    block), rows shared out in groups of unequal tile counts (1300 rows: several groups a thread),
    and contractions summed in several chunks (the AMX engine's 1024, the others' 4096),
    and each operand is read row- and column-major (HLA's ``q(P g)ᵀ``, the forward's ``q(W)ᵀ``).
    A reaches -128, whose sign bit the VNNI and AVX2 engines flip to offset it; B reaches the engine's
    bound (AVX2's: ±64)."""
    engine = cpu_gemm.fused_gemm()  # asked here: the library loads under the session's cache (conftest)
    if not engine:
        pytest.skip("HOT's own GEMM needs AMX-INT8, AVX512-VNNI or AVX2 and a build of the library with it")
    monkeypatch.setattr(cpu_gemm, "VNNI_CONTRACTION_PER_ROW", math.inf)  # every shape on it, the long contractions too
    m, k, n = shape
    b_max = cpu_gemm.AVX2_B_MAX if engine == "avx2" else int8_gemm.INT8_MAX
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    b = torch.randint(-b_max, min(b_max, 127) + 1, (k, n), dtype=torch.int8)
    row_scale, col_scale, bias = torch.rand(m, 1), torch.rand(n), torch.randn(n)

    def no_matmul(a, b):
        raise AssertionError("the chunked path ran where HOT's own GEMM should")

    def product(a, b, matmul=no_matmul, **bias_arg):
        return cpu_gemm.matmul_dequantized(a, b, row_scale, col_scale, 16, out_dtype, matmul, **bias_arg, b_max=b_max)

    fused = [product(x, y, bias=bias) for x in (a, a.t().contiguous().t()) for y in (b, b.t().contiguous().t())]
    fused_without_bias = product(a, b)
    monkeypatch.setattr(cpu_gemm, "fused_gemm", lambda: "")
    expected = product(a, b, int8_gemm.int8_matmul, bias=bias)
    assert all(torch.equal(out, expected) for out in fused)
    assert torch.equal(fused_without_bias, product(a, b, int8_gemm.int8_matmul))


def test_cpu_ops_run_the_fused_gemm_where_the_cpu_has_it(monkeypatch):
    """With AMX, VNNI or AVX2 (at 7 bits, within its bound), HOT's ops call neither ``torch._int_mm`` nor
    any other integer product for a contraction at most 4× its rows (here all of them), and their
    gradients are the chunked path's."""
    engine = cpu_gemm.fused_gemm()
    if not engine:
        pytest.skip("HOT's own GEMM needs AMX-INT8, AVX512-VNNI or AVX2 and a build of the library with it")
    bits = 7 if engine == "avx2" else 8
    g, w, x = make("gaussian", 100, 48, 0), make("gaussian", 48, 40, 1), make("gaussian", 100, 40, 2)
    xq, xs = ops.compress_activation(x, 16, bits, True)

    def grads():
        return ops.hq_grad_input(g, w, SEED, bits, bits, True, True, "per_channel"), ops.hla_grad_weight(g, xq, xs, SEED, 16, bits, True, torch.float32)

    with monkeypatch.context() as chunked:
        chunked.setattr(cpu_gemm, "fused_gemm", lambda: "")
        expected = grads()

    def no_product(*args, **kwargs):
        raise AssertionError("an integer product called where HOT's own GEMM runs")

    monkeypatch.setattr(torch, "_int_mm", no_product)
    monkeypatch.setattr(int8_gemm, "int8_matmul", no_product)
    assert all(torch.equal(a, b) for a, b in zip(grads(), expected))


def test_cpu_ops_run_the_fused_kernels(monkeypatch):
    """On the CPU each op runs its kernels, not the shape-generic compile of the composites."""
    calls = []
    for module, name in ((cpu_kernels, "quantize_rows"), (cpu_kernels, "column_amax"), (cpu_kernels, "quantize_columns"), (cpu_gemm, "matmul_dequantized")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    built = ops._build_seconds
    g, w, x = make("gaussian", 64, 48, 0), make("gaussian", 48, 32, 1), make("gaussian", 64, 32, 2)
    ops.hq_grad_input(g, w, SEED, 8, 8, True, True, "per_channel")
    assert calls == ["quantize_rows", "column_amax", "quantize_columns", "matmul_dequantized"]
    calls.clear()
    xq, xs = ops.compress_activation(x, 16, 8, True)
    ops.hla_grad_weight(g, xq, xs, SEED, 16, 8, True, torch.float32)
    assert calls == ["column_amax", "quantize_columns"] * 2 + ["matmul_dequantized"]
    calls.clear()
    for name in ("encode_rows", "encode_derivative"):
        original = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    ops.encode_rows(x, 8)
    ops.encode_derivative(x, SEED, 4, "gelu")
    assert calls == ["encode_rows", "encode_derivative"]
    assert ops._build_seconds == built


def test_unsupported_dtype_is_named():
    with pytest.raises(TypeError, match="float64"):
        cpu_kernels.quantize_rows(torch.zeros(4, 16, dtype=torch.float64), 8, width=16, hadamard=True, per_row=True)


def test_the_pass_starts_loading_the_cpu_kernels(monkeypatch):
    """The graph passes start the library's build when they insert CPU ops, before their first call."""
    devices = []
    prepare = ops.prepare
    monkeypatch.setattr(ops, "prepare", lambda device: devices.append(device) or prepare(device))
    compiled, graphs = aot_compile(MLP(32, 64, 32), HotConfig(policy="hot", strict=True))
    compiled(torch.randn(2, 16, 32)).sum().backward()
    assert devices and set(devices) == {torch.device("cpu")}
    assert any(node.target is torch.ops.hot_compile.hq_grad_input.default for node in graphs.backward.graph.nodes)


def _no_inductor_build(*args, **kwargs):
    raise AssertionError("Inductor was asked to build the library")


def test_the_library_is_kept_outside_inductors_cache(monkeypatch):
    """A process with a fresh Inductor cache loads this machine's build from HOT's own cache."""
    from torch._inductor.codecache import CppCodeCache

    path = cpu_kernels.build()  # kept under this session's HOT_CACHE_DIR (conftest)
    assert path.is_file() and path.parent == pathlib.Path(os.environ["HOT_CACHE_DIR"])
    monkeypatch.setattr(CppCodeCache, "load", _no_inductor_build)
    assert cpu_kernels._load()._name == str(path)


def test_build_kernels_command_names_the_kept_library(capsys):
    from hot_compile import cli

    assert cli.main(["build-kernels"]) == 0
    assert str(cpu_kernels.library_path()) in capsys.readouterr().out and cpu_kernels.library_path().is_file()


def test_an_unwritable_cache_only_costs_a_build(monkeypatch, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("HOT_CACHE_DIR", str(not_a_folder))
    library = cpu_kernels._load()  # built (or found) by Inductor, nothing kept
    assert library.hot_rows_quantize is not None and not cpu_kernels.library_path().exists()


def test_vnni_gemm_leaves_long_contractions_of_few_rows_to_int_mm(monkeypatch):
    """On the VNNI engine a product whose contraction is over 4× its rows (HLA's ``[N, L] × [L, K]`` of a
    narrow layer) runs ``torch._int_mm`` in row chunks, whose packing of B is faster there; the AMX
    engine runs every product."""
    if cpu_gemm.fused_gemm() != "vnni":
        pytest.skip("the VNNI engine's dispatch: this CPU runs " + (cpu_gemm.fused_gemm() or "no engine of its own"))
    calls = []
    product = int8_gemm.int8_matmul

    def counted(a, b):
        calls.append(a.shape)
        return product(a, b)

    a = torch.randint(-127, 128, (16, 65), dtype=torch.int8)
    b = torch.randint(-127, 128, (65, 8), dtype=torch.int8)
    long = cpu_gemm.matmul_dequantized(a, b, torch.ones(16), torch.ones(8), 1, torch.float32, counted)
    assert calls == [(16, 65)]
    short = cpu_gemm.matmul_dequantized(a[:, :64], b[:64], torch.ones(16), torch.ones(8), 1, torch.float32, counted)
    assert calls == [(16, 65)]
    assert torch.equal(long, (a.double() @ b.double()).float())
    assert torch.equal(short, (a[:, :64].double() @ b[:64].double()).float())
