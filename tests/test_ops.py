import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hot_compile.runtime import aten_impl, hadamard, int8_gemm, ops
from tests import reference
from tests import tolerances as tol
from tests.data import KINDS, make, rel_err
from tests.harness import pin_int8_path

SEED = torch.tensor(11)
L, N, K = 400, 136, 72  # neither L nor N a multiple of 16
# HQ as the paper runs it: INT4, one scale for the gradient, SAWB for the weight.
PAPER_HQ = dict(grad_bits=4, weight_bits=4, per_token=False, weight_quantizer="sawb")


class _CpuKernels:
    """HOT's custom ops, whose CPU kernels are the fused loops of :mod:`hot_compile.runtime.cpu_kernels`, called
    like the functions of :mod:`hot_compile.runtime.aten_impl`."""

    @staticmethod
    def hq_grad_input(g, w, seed, *, grad_bits=8, weight_bits=8, per_token=True, hadamard=True, weight_quantizer="per_channel"):
        return ops.hq_grad_input(g, w, seed, grad_bits, weight_bits, per_token, hadamard, weight_quantizer)

    @staticmethod
    def compress_activation(x, *, rank=16, bits=8, per_channel=True):
        return ops.compress_activation(x, rank, bits, per_channel)

    @staticmethod
    def hla_grad_weight(g, xq, xs, seed, *, rank=16, bits=8, per_channel=True, out_dtype=None):
        return ops.hla_grad_weight(g, xq, xs, seed, rank, bits, per_channel, out_dtype or g.dtype)


@pytest.fixture(params=["composite", "cpu_kernel"])
def impl(request):
    """Each test of the numerics runs on both implementations of HOT's ops: the aten composites (what
    other devices compile) and the CPU ops."""
    return aten_impl if request.param == "composite" else _CpuKernels


def _operands(kind, seed=0):
    g = make(kind, L, N, seed)
    w = make("gaussian", N, K, seed + 1) / N**0.5
    x = make(kind, L, K, seed + 2)
    return g, w, x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("weight_quantizer", ["per_channel", "stochastic", "sawb"])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("shape", [(L,), (5, 80), (2, 4, 50)])
def test_hq_matches_reference_2d_and_nd(impl, per_token, shape, weight_quantizer, bits):
    g = make("gaussian", int(torch.tensor(shape).prod()), N).reshape(*shape, N)
    w = make("gaussian", N, K, 1)
    settings = dict(grad_bits=bits, weight_bits=bits, per_token=per_token, weight_quantizer=weight_quantizer)
    out = impl.hq_grad_input(g, w, SEED, **settings)
    assert out.shape == (*shape, K) and out.dtype == g.dtype
    assert rel_err(out, reference.hq_grad_input(g, w, SEED, **settings)) < tol.FP32_VS_REFERENCE


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("tokens", [L, 197])
@pytest.mark.parametrize("rank", [1, 8, 16])
def test_compress_and_hla_match_reference(impl, rank, tokens, per_channel):
    g, _, x = _operands("gaussian")
    g, x = g[:tokens], x[:tokens]
    xq, xs = impl.compress_activation(x.reshape(1, tokens, K), rank=rank, per_channel=per_channel)
    assert xq.dtype == torch.int8 and xq.shape == (hadamard.lowpass_rows(tokens, rank), K)
    assert xs.shape == ((1, K) if per_channel else ())
    ref_q, ref_s = reference.compress_activation(x, rank=rank, per_channel=per_channel)
    assert (xq.double() != ref_q).float().mean() <= tol.LEVEL_MISMATCH_FRACTION
    out = impl.hla_grad_weight(g, xq, xs, SEED, rank=rank, per_channel=per_channel)
    assert out.shape == (N, K)
    ref = reference.hla_grad_weight(g, ref_q, ref_s, SEED, rank=rank, per_channel=per_channel)
    assert rel_err(out, ref) < tol.FP32_VS_REFERENCE


def test_lowpass_at_full_rank_is_exact():
    g, _, x = _operands("gaussian")
    gd, xd = g.double(), x.double()
    torch.testing.assert_close(reference.lowpass_product(gd, xd, 16), gd.T @ xd, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_hla_full_rank_equals_gtx_up_to_quantization(kind):
    g, _, x = _operands(kind)
    exact = g.double().T @ x.double()
    errors = {}
    for per_channel in (False, True):
        xq, xs = aten_impl.compress_activation(x, rank=16, per_channel=per_channel)
        errors[per_channel] = rel_err(aten_impl.hla_grad_weight(g, xq, xs, SEED, rank=16, per_channel=per_channel), exact)
    print(f"HLA r=16 INT8 {kind}: rel err per-tensor {errors[False]:.4f}, per-channel {errors[True]:.4f}")
    assert errors[False] < (tol.HLA_FULL_RANK_OUTLIER if kind == "outlier" else tol.HLA_FULL_RANK)
    assert errors[True] < tol.INT8_PER_SLICE_PRODUCT


@pytest.mark.parametrize("kind", KINDS)
def test_hla_rank8_matches_lowpass_product(kind):
    g, _, x = _operands(kind)
    xq, xs = aten_impl.compress_activation(x, rank=8)
    err = rel_err(aten_impl.hla_grad_weight(g, xq, xs, SEED, rank=8), reference.lowpass_product(g.double(), x.double()))
    assert err < tol.HLA_RANK8_VS_LOWPASS * (3 if kind == "outlier" else 1)


def test_hla_rank8_on_token_smooth_data():
    g = make("smooth", L, N, 3)
    x = make("smooth", L, K, 4)
    xq, xs = aten_impl.compress_activation(x, rank=8)
    err = rel_err(aten_impl.hla_grad_weight(g, xq, xs, SEED, rank=8), g.double().T @ x.double())
    print(f"HLA r=8 INT8 on token-smooth data: rel err {err:.4f}")
    assert err < tol.HLA_RANK8_SMOOTH


@pytest.mark.parametrize("kind", KINDS)
def test_hq_error_bands(kind):
    g, w, _ = _operands(kind)
    exact = g.double() @ w.double()
    per_tensor = max(rel_err(aten_impl.hq_grad_input(g, w, torch.tensor(s), **PAPER_HQ), exact) for s in range(4))
    paper_per_token = {**PAPER_HQ, "per_token": True}
    per_token = max(rel_err(aten_impl.hq_grad_input(g, w, torch.tensor(s), **paper_per_token), exact) for s in range(4))
    defaults = max(rel_err(aten_impl.hq_grad_input(g, w, torch.tensor(s)), exact) for s in range(4))
    print(f"HQ INT4 {kind}: per-tensor {per_tensor:.3f}, per-token {per_token:.3f}; INT8 defaults {defaults:.4f}")
    band = {"gaussian": tol.HQ_GAUSSIAN, "lognormal": tol.HQ_LOGNORMAL_PER_TENSOR, "outlier": tol.HQ_OUTLIER}
    assert per_tensor < band[kind]
    assert per_token < (tol.HQ_LOGNORMAL_PER_TOKEN if kind == "lognormal" else band[kind])
    assert defaults < tol.INT8_PER_SLICE_PRODUCT


@pytest.mark.parametrize("kind", ["lognormal", "outlier"])
def test_hadamard_lowers_int4_error_on_outliers(kind):
    g, w, _ = _operands(kind)
    exact = g.double() @ w.double()
    seeds = [torch.tensor(s) for s in range(8)]
    with_h = sum(rel_err(aten_impl.hq_grad_input(g, w, s, **PAPER_HQ), exact) for s in seeds) / len(seeds)
    plain = sum(rel_err(aten_impl.hq_grad_input(g, w, s, hadamard=False, **PAPER_HQ), exact) for s in seeds) / len(seeds)
    print(f"INT4 {kind}: Hadamard {with_h:.3f} vs plain {plain:.3f}")
    assert with_h < 0.75 * plain


def test_hq_is_unbiased_over_draws(impl):
    g, w, _ = _operands("gaussian")
    # The weight operand is deterministic (SAWB round-to-nearest), so the expectation over the
    # gradient's stochastic rounding is the exact product with the dequantized transformed weight.
    qw, sw = reference.sawb(reference.block_transform(w, reference.sylvester_hadamard(), 0), 4)
    w_hat = reference.block_transform(qw * sw, reference.sylvester_hadamard(), 0)[:N] / 16
    expectation = g.double() @ w_hat
    mean = sum(impl.hq_grad_input(g, w, torch.tensor(s), **PAPER_HQ).double() for s in range(tol.UNBIASED_DRAWS))
    mean = mean / tol.UNBIASED_DRAWS
    reached = rel_err(mean, expectation)
    single = rel_err(impl.hq_grad_input(g, w, SEED, **PAPER_HQ), expectation)
    print(f"HQ mean of {tol.UNBIASED_DRAWS} draws: rel err {reached:.4f} (one draw {single:.3f}, bound {tol.UNBIASED_MEAN})")
    assert reached < tol.UNBIASED_MEAN


@pytest.mark.parametrize("weight_quantizer", ["per_channel", "stochastic"])
@pytest.mark.parametrize("bits", [4, 8])
def test_hq_with_stochastic_weight_is_unbiased_against_the_exact_product(impl, bits, weight_quantizer):
    g, w, _ = _operands("gaussian")
    exact = g.double() @ w.double()

    def mean(quantizer):
        draws = (
            impl.hq_grad_input(g, w, torch.tensor(s), grad_bits=bits, weight_bits=bits, weight_quantizer=quantizer)
            for s in range(tol.UNBIASED_DRAWS)
        )
        return sum(d.double() for d in draws) / tol.UNBIASED_DRAWS

    unbiased, sawb = rel_err(mean(weight_quantizer), exact), rel_err(mean("sawb"), exact)
    print(f"HQ INT{bits}, mean of {tol.UNBIASED_DRAWS} draws vs g @ W: {weight_quantizer} {unbiased:.4f}, SAWB {sawb:.4f}")
    assert unbiased < tol.UNBIASED_MEAN
    # SAWB's clip cuts the transformed weight's tails at every bit width: a bias no draw count removes.
    assert sawb > 2 * unbiased


@pytest.mark.parametrize("per_channel", [False, True])
def test_hla_is_unbiased_over_draws(impl, per_channel):
    g, _, x = _operands("gaussian")
    xq, xs = impl.compress_activation(x, rank=8, per_channel=per_channel)
    p = reference.sequency_sorted_rows(8)
    expectation = reference.block_transform(g, p, 0).T @ (xq.double() * xs.double()) / 16
    draws = (impl.hla_grad_weight(g, xq, xs, torch.tensor(s), rank=8, per_channel=per_channel) for s in range(tol.UNBIASED_DRAWS))
    mean = sum(d.double() for d in draws) / tol.UNBIASED_DRAWS
    assert rel_err(mean, expectation) < tol.UNBIASED_MEAN / 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(impl, dtype):
    g, w, x = _operands("gaussian")
    out = impl.hq_grad_input(g.to(dtype), w.to(dtype), SEED)
    assert out.dtype == dtype
    assert rel_err(out, g.double() @ w.double()) < tol.HQ_HALF_PRECISION
    xq, xs = impl.compress_activation(x.to(dtype), rank=16)
    gw = impl.hla_grad_weight(g.to(dtype), xq, xs, SEED, rank=16, out_dtype=torch.float32)
    assert gw.dtype == torch.float32
    assert rel_err(gw, g.double().T @ x.double()) < tol.HLA_FULL_RANK


def test_zero_gradient_gives_zero_finite_output(impl):
    _, w, x = _operands("gaussian")
    g = torch.zeros(L, N)
    assert torch.equal(impl.hq_grad_input(g, w, SEED), torch.zeros(L, K))
    xq, xs = impl.compress_activation(torch.zeros(L, K))
    assert torch.isfinite(xs).all() and not xq.any()
    assert torch.equal(impl.hla_grad_weight(g, *impl.compress_activation(x), SEED), torch.zeros(N, K))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("per_token", [False, True])
def test_non_finite_propagates(impl, bad, per_token):
    g, w, x = _operands("gaussian")
    g[17, 5] = bad
    assert not torch.isfinite(impl.hq_grad_input(g, w, SEED, per_token=per_token)[17]).all()
    assert not torch.isfinite(impl.hla_grad_weight(g, *impl.compress_activation(x), SEED)).all()
    x[3, 2] = bad
    assert not torch.isfinite(impl.hla_grad_weight(g.nan_to_num(), *impl.compress_activation(x), SEED)).all()
    w[0, 0] = bad
    assert not torch.isfinite(impl.hq_grad_input(g.nan_to_num(), w, SEED)).all()


class _RecordCalls(TorchDispatchMode):
    """The tensor arguments and the output of every call of ``op``."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is self.op:
            self.calls.append(([a for a in args if isinstance(a, torch.Tensor)], out))
        return out


@pytest.mark.usefixtures("native_int8")
def test_integer_matmul_is_int8_to_int32():
    g, w, x = _operands("gaussian")
    with _RecordCalls(torch.ops.aten._int_mm.default) as rec:
        aten_impl.hq_grad_input(g, w, SEED)
        aten_impl.hla_grad_weight(g, *aten_impl.compress_activation(x), SEED)
    assert [(a.dtype, b.dtype, out.dtype) for (a, b), out in rec.calls] == [(torch.int8, torch.int8, torch.int32)] * 2


@pytest.mark.parametrize("k", [16, int8_gemm.exact_float32_length(), int8_gemm.exact_float32_length() + 16, 3000])
def test_int8_matmul_is_exact_on_either_path(int8_path, k):
    # The extremes make every partial sum as large as int8 allows: -128·-128 summed K times.
    a = torch.randint(-128, 128, (33, k), dtype=torch.int8)
    b = torch.randint(-128, 128, (k, 24), dtype=torch.int8)
    a[0], b[:, 0] = -128, -128
    exact = (a.long() @ b.long()).to(torch.int32)
    out = int8_gemm.int8_matmul(a, b.t().contiguous().t())  # a column-major operand, as HLA passes
    assert out.dtype == torch.int32 and torch.equal(out, exact)
    assert out[0, 0] == 128 * 128 * k


def test_long_int8_contraction_runs_in_equal_pieces(monkeypatch):
    pin_int8_path(monkeypatch, "float")
    k = 2 * int8_gemm.exact_float32_length() + 2  # three pieces of k/3, not of the longest exact length
    a = torch.randint(-128, 128, (5, k), dtype=torch.int8)
    b = torch.randint(-128, 128, (k, 4), dtype=torch.int8)
    with _RecordCalls(torch.ops.aten.bmm.default) as rec:
        out = int8_gemm.int8_matmul(a, b)
    [((pieces_a, _), _)] = rec.calls
    assert pieces_a.shape == (3, 5, -(-k // 3))  # 684 columns each: 2 of padding in all
    assert torch.equal(out, (a.long() @ b.long()).to(torch.int32))


def test_int8_matmul_of_int4_values_is_exact_in_one_product(int8_path):
    k = 20000  # 20000 · 7 · 7 < 2**24: one float32 product, no pieces
    a = torch.full((3, k), -7, dtype=torch.int8)
    b = torch.randint(-7, 8, (k, 5), dtype=torch.int8)
    b[:, 0] = -7
    with _RecordCalls(torch.ops.hot_compile.u8s8_linear.default) as rec:
        out = int8_gemm.int8_matmul(a, b, 7, 7)
    assert torch.equal(out, (a.long() @ b.long()).to(torch.int32)) and out[0, 0] == 49 * k
    assert len(rec.calls) == (int8_path == "u8s8")


def test_u8s8_product_is_exact_up_to_its_int16_bound(monkeypatch):
    """oneDNN's uint8 × int8 GEMM without VNNI adds adjacent products in saturating int16: with ``a``
    shifted by 127 to 254 and ``b`` at ±64, a pair sums to ±32512, within int16; at ±65 it would not."""
    pin_int8_path(monkeypatch, "u8s8")
    assert int8_gemm.u8s8_exact(127, 64) and not int8_gemm.u8s8_exact(127, 65) and not int8_gemm.u8s8_exact(127, 127)
    k = 1000
    a = torch.randint(-127, 128, (40, k), dtype=torch.int8)
    b = torch.randint(-64, 65, (k, 30), dtype=torch.int8)
    a[0], b[:, 0], b[:, 1] = 127, 64, -64  # every pair sum of out[0, :2] at ±2·254·64
    with _RecordCalls(torch.ops.hot_compile.u8s8_linear.default) as rec:
        out = int8_gemm.int8_matmul(a, b, 127, 64)
    assert len(rec.calls) == 1 and torch.equal(out, (a.long() @ b.long()).to(torch.int32))
    with _RecordCalls(torch.ops.hot_compile.u8s8_linear.default) as rec:
        int8_gemm.int8_matmul(a, b, 127, 127)
    assert not rec.calls  # two INT8 operands take the float GEMM


def test_int8_matmul_rejects_float():
    with pytest.raises(TypeError, match="int8"):
        int8_gemm.int8_matmul(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.int8))


def test_draw_seed_follows_manual_seed():
    like = torch.empty(3)
    torch.manual_seed(0)
    a = ops.draw_seed(like)
    torch.manual_seed(0)
    assert ops.draw_seed(like) == a and a.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hadamard", [True, False])
@pytest.mark.parametrize("per_token", [True, False])
def test_custom_ops_match_the_eager_functions(dtype, hadamard, per_token):
    """HOT's custom ops (on the CPU, the fused kernels) against :mod:`hot_compile.runtime.aten_impl` run eagerly, on a
    column-major gradient and a Parameter weight, as a backward hands them over: the same integer
    levels up to ties at a rounding boundary."""
    g, w, x = _operands("gaussian")
    g = g.to(dtype).t().contiguous().t()
    w, x = torch.nn.Parameter(w.to(dtype)), x.to(dtype)
    for rank, per_channel in ((8, True), (16, not per_token)):
        xq, xs = ops.compress_activation(x, rank, 8, per_channel)
        ref_q, ref_s = aten_impl.compress_activation(x, rank=rank, per_channel=per_channel)
        assert (xq != ref_q).float().mean() <= tol.LEVEL_MISMATCH_FRACTION and torch.allclose(xs, ref_s)
        hla = ops.hla_grad_weight(g, xq, xs, SEED, rank, 8, per_channel, torch.float32)
        ref = aten_impl.hla_grad_weight(g, xq, xs, SEED, rank=rank, per_channel=per_channel, out_dtype=torch.float32)
        assert hla.dtype == torch.float32 and rel_err(hla, ref) < tol.FP32_VS_REFERENCE
    for weight_quantizer in ("per_channel", "stochastic", "sawb"):
        settings = dict(per_token=per_token, hadamard=hadamard, weight_quantizer=weight_quantizer)
        hq = ops.hq_grad_input(g, w, SEED, 8, 8, per_token, hadamard, weight_quantizer)
        assert hq.dtype == dtype and rel_err(hq, aten_impl.hq_grad_input(g, w, SEED, **settings)) < tol.FP32_VS_REFERENCE


def test_custom_ops_pass_opcheck():
    g, w, x = _operands("gaussian")
    for per_channel in (False, True):
        xq, xs = aten_impl.compress_activation(x, rank=8, per_channel=per_channel)
        torch.library.opcheck(ops.compress_activation, (x, 8, 8, per_channel))
        torch.library.opcheck(ops.hla_grad_weight, (g, xq, xs, SEED, 8, 8, per_channel, torch.float32))
    for weight_quantizer in ("per_channel", "stochastic"):
        torch.library.opcheck(ops.hq_grad_input, (g, w, SEED, 4, 4, False, True, weight_quantizer))
    if torch.backends.mkldnn.is_available():
        a = torch.randint(0, 15, (L, K), dtype=torch.uint8)
        torch.library.opcheck(int8_gemm.u8s8_linear, (a, 7, torch.randint(-7, 8, (N, K), dtype=torch.int8)))


def test_one_kernel_serves_every_shape():
    """The ops' compiled kernels (every device but the CPU) are compiled for symbolic shapes: a new layer shape, or a token count with
    another remainder mod 16, builds nothing."""
    g, w, x = _operands("gaussian")

    def step(tokens, n, k):
        gs, ws, xs = g[:tokens, :n].contiguous(), w[:n, :k].contiguous(), x[:tokens, :k].contiguous()
        ops.compiled_hq_grad_input(gs, ws, SEED, 8, 8, True, True, "per_channel")
        ops.compiled_hla_grad_weight(gs, *ops.compiled_compress_activation(xs, 8, 8, True), SEED, 8, 8, True, torch.float32)

    step(L, N, K)
    built = ops.build_seconds()
    step(197, 100, 40)
    step(300, 100, 40)
    assert ops.build_seconds() == built


def test_kernels_take_their_integer_settings_as_constants():
    """Shapes are symbolic in the kernels, rank and bits are not: a symbolic rank would make every
    shape expression a product of symbols, which the trace and Inductor then simplify at length."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    _, _, x = _operands("gaussian")
    ops.compiled_compress_activation(x, 4, 6, True)
    kernel = ops._kernel(aten_impl.compress_activation, (("bits", 6), ("per_channel", True), ("rank", 4)))
    (entry,) = _debug_get_cache_entry_list(kernel._torchdynamo_orig_callable.__code__)
    guards = entry.guard_manager.code_parts
    assert "L['settings']['rank'] == 4" in guards and "L['settings']['bits'] == 6" in guards


def test_kernels_build_once_whatever_the_dispatch_state():
    """AOTAutograd runs a compiled graph's first call under a dispatch mode that checks custom ops
    for aliasing; the ops' kernels built there serve the calls after it."""
    _, _, x = _operands("gaussian")

    class CompiledKernelUnderMode(TorchDispatchMode):
        """Runs the op's compiled implementation where the mode hands the op on, as on a GPU."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.hot_compile.compress_activation.default:
                return ops.compiled_compress_activation(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    with CompiledKernelUnderMode():
        ops.compress_activation(x, 8, 8, True)
    built = ops.build_seconds()
    ops.compiled_compress_activation(x, 8, 8, True)
    assert ops.build_seconds() == built


def test_kernels_build_once_for_views_and_parameters():
    """A backward hands the ops views in one call and fresh tensors or Parameters in the next."""
    g, w, _ = _operands("gaussian")
    ops.compiled_hq_grad_input(g[:300], torch.cat([w, w])[:N], SEED, 8, 8, True, True, "per_channel")  # contiguous views
    built = ops.build_seconds()
    ops.compiled_hq_grad_input(g[:300].clone(), torch.nn.Parameter(w.clone()), SEED, 8, 8, True, True, "per_channel")
    assert ops.build_seconds() == built
