"""What the forward saves for the backward, compressed (:mod:`hot_compile.passes.saved_activations`):
the codes against float64, the gradients each code gives within the bound of its bits, and what a
compiled model saves."""

import dataclasses
import functools
import math
import types
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot_compile
import hot_compile.passes as hot_passes
from hot_compile import HotConfig
from hot_compile.harness import models
from hot_compile.inductor_pass import HotPassWarning
from hot_compile.passes.cost_model import SiteCost
from hot_compile.passes.provenance import META_KEY
from hot_compile.passes.report import SiteRow
from hot_compile.passes.saved_activations import DERIVATIVE, DERIVATIVE_BITS, INT8_ROWS
from hot_compile.passes.saved_budget import keep_over_budget, step_floor
from hot_compile.runtime import aten_impl, quant
from tests import tolerances as tol
from tests.data import make, rel_err
from tests.harness import aot_compile

# Products left exact, so that a gradient's error is the saved values' alone.
EXACT_PRODUCTS = dict(rewrite_gx=False, rewrite_gw=False, forward_bits=None)
ON = dict(strict=True, policy="hot", compress_saved=True)
SEED = torch.tensor(7)


# ------------------------------------------------------------------------------------------ the codes


@pytest.mark.parametrize("kind", ["gaussian", "lognormal", "outlier"])
def test_int8_rows_are_within_half_a_level_of_float64(kind):
    x = make(kind, 64, 96, dtype=torch.float64)
    q, scale = quant.quantize_nearest(x.float(), 8, dim=-1)
    error = (quant.dequantize(q, scale).double() - x).abs()
    bound = x.abs().amax(dim=-1, keepdim=True) * (tol.HALF_INT8_LEVEL + tol.FP32_ROUNDINGS)
    assert (error <= bound).all(), (error / bound).max()


def test_derivative_code_is_unbiased_within_a_step_and_codes_zero_exactly():
    f = aten_impl.DERIVATIVES["gelu"](make("gaussian", 16, 64, dtype=torch.float64) * 3)
    f[:, :4] = 0  # a saturated unit's derivative
    draws = []
    for s in range(tol.SR_DRAWS):
        codes, lo, step = quant.quantize_range_stochastic(f.float(), DERIVATIVE_BITS, torch.tensor(s))
        assert codes.dtype == torch.uint8 and int(codes.max()) < 2**DERIVATIVE_BITS
        decoded = (lo + codes.float() * step).double()
        assert ((decoded - f).abs() < step.double() * (1 + tol.FP32_ROUNDINGS)).all()
        assert (decoded[:, :4] == 0).all()
        draws.append(decoded)
    mean = torch.stack(draws).mean(0)
    print(f"mean of {tol.SR_DRAWS} draws: rel err {rel_err(mean, f):.4f}, one draw {rel_err(draws[0], f):.3f}")
    assert rel_err(mean, f) < tol.SR_MEAN


def test_two_codes_a_byte_round_trip_eager_and_compiled():
    codes = torch.randint(0, 16, (3, 5, 40), dtype=torch.uint8)
    packed = quant.pack_nibbles(codes)
    assert packed.shape == (3, 5, 20) and packed.dtype == torch.uint8
    assert torch.equal(packed, codes[..., :20] + 16 * codes[..., 20:])  # the halves, low and high
    assert torch.equal(quant.unpack_nibbles(packed), codes)
    assert torch.equal(torch.compile(lambda c: quant.unpack_nibbles(quant.pack_nibbles(c)))(codes), codes)


# ----------------------------------------------------------------------------- gradients, per code


class Bilinear(nn.Module):
    """``(x W₁ᵀ) ⊙ (x W₂ᵀ)``: each product's backward reads the other's output as it is."""

    def __init__(self, dim=24, hidden=48):
        super().__init__()
        self.a, self.b = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.a(x) * self.b(x)


def _compiled_grads(model, x, gy, **options):
    compiled, graphs = aot_compile(model, HotConfig(**ON, **EXACT_PRODUCTS, **options))
    x = x.clone().requires_grad_()
    compiled(x).backward(gy)
    return x.grad, graphs, hot_compile.last_report()


class LinearThen(nn.Module):
    """``f(x Wᵀ + b)`` for a pointwise ``f``."""

    def __init__(self, function, dim=24, hidden=48):
        super().__init__()
        self.fc, self.function = nn.Linear(dim, hidden), function

    def forward(self, x):
        return self.function(self.fc(x))


def _derivative_step(function):
    torch.manual_seed(0)
    model, x, gy = LinearThen(function), torch.randn(64, 24) * 2, torch.randn(64, 48)
    grad, graphs, report = _compiled_grads(model, x, gy)
    (row,) = report.select(path="saved")
    assert row.decision == DERIVATIVE
    assert row.saved_bytes_after == 64 * 48 // 2 + 2 * 4 * 64 < row.saved_bytes_before / 5
    assert [tuple(t.shape) for t in graphs.saved() if t.dtype == torch.uint8] == [(64, 24)]
    (encoder,) = graphs.nodes("forward", torch.ops.hot_compile.encode_derivative.default)
    w, h = model.fc.weight.double(), (x.double() @ model.fc.weight.double().T + model.fc.bias.double())
    return grad, gy.double(), w, h, graphs, row, encoder


def _within_a_step(grad, gy, w, f, rounding):
    """Each element of ``f`` (``f(x)`` as the encoder read it, within ``rounding`` of the exact, which
    may also widen its row's range by as much on each side) is off by less than one step of its row,
    (max f − min f) / 14, so the linear output's gradient is off by at most |gy|·(step + rounding),
    and x's by that times |W|."""
    step = (f.amax(-1, keepdim=True) - f.amin(-1, keepdim=True) + 2 * rounding) / (2**DERIVATIVE_BITS - 2)
    exact = (gy * f) @ w
    bound = (gy.abs() * (step + rounding)) @ w.abs() + tol.FP32_VS_REFERENCE * exact.abs().max()
    error = (grad.double() - exact).abs()
    print(f"x.grad: error {rel_err(grad, exact):.4f} relative, worst element at {(error / bound).max():.2f} of its bound")
    assert (error <= bound).all() and rel_err(grad, exact) > 0


@pytest.mark.parametrize(
    "function, name",
    [(F.gelu, "gelu"), (functools.partial(F.gelu, approximate="tanh"), "gelu_tanh")],
)
def test_a_known_derivative_is_computed_by_the_encoder_and_bounds_the_gradient_by_one_step(function, name):
    """GELU's derivatives, exact and with tanh, are named from what the backward's nodes compute;
    the encoder computes the derivative from the linear's float32 output itself, so neither graph
    holds its arithmetic, and the gradient is off by one step of the exact derivative's row at most."""
    grad, gy, w, h, graphs, row, encoder = _derivative_step(function)
    assert f"{name}'(x)" in row.reason and "computed from x in float32" in row.numerics
    assert encoder.args[3] == name and encoder.args[0].meta["val"].dtype == torch.float32
    created = [n for n in graphs.nodes("forward") if n.meta.get(META_KEY, {}).get("rewrite") == "compress_saved"]
    assert all(torch.Tag.pointwise not in getattr(n.target, "tags", ()) for n in created)  # views, the seed, the encoder
    assert not graphs.nodes("backward", torch.ops.aten.exp.default) and not graphs.nodes("backward", torch.ops.aten.erf.default)
    _within_a_step(grad, gy, w, aten_impl.DERIVATIVES[name](h), tol.DERIVATIVE_EVALUATION)


def test_another_derivative_is_computed_by_the_forward_and_coded_from_its_bf16_rounding():
    """sin's derivative, cos, is not one the encoder computes: the forward computes it with the
    backward's own nodes, and the encoder codes its bf16 rounding (half a bf16 level of |f|)."""
    grad, gy, w, h, graphs, row, encoder = _derivative_step(torch.sin)
    assert "cos" in row.reason and "in bfloat16" in row.numerics
    assert encoder.args[3] == aten_impl.GIVEN and encoder.args[0].meta["val"].dtype == torch.bfloat16
    assert graphs.nodes("forward", torch.ops.aten.cos.default) and not graphs.nodes("backward", torch.ops.aten.cos.default)
    f = h.cos()
    _within_a_step(grad, gy, w, f, tol.BF16_ROUNDING / 2 * f.abs().amax(-1, keepdim=True))


def test_without_the_derivative_code_a_gelu_input_is_saved_as_int8_rows():
    torch.manual_seed(0)
    _, graphs, report = _compiled_grads(LinearThen(F.gelu), torch.randn(64, 24), torch.randn(64, 48), saved_derivative_bits=None)
    assert [r.decision for r in report.select(path="saved")] == [INT8_ROWS]
    assert graphs.nodes("backward", torch.ops.aten.erf.default)  # GELU's derivative computed in the backward
    with pytest.raises(ValueError, match="saved_derivative_bits"):
        HotConfig(saved_derivative_bits=3)


def test_a_float64_model_keeps_its_saved_values_and_trains():
    torch.manual_seed(0)
    model = LinearThen(F.gelu).double()
    compiled, _ = aot_compile(model, HotConfig(**ON))
    compiled(torch.randn(64, 24, dtype=torch.float64)).sum().backward()
    rows = hot_compile.last_report().select(path="saved")
    assert rows and all(r.decision == "kept" and "float64" in r.reason for r in rows)
    assert model.fc.weight.grad is not None


def test_int8_rows_bound_the_gradient_by_half_a_level():
    torch.manual_seed(0)
    model, x, gy = Bilinear(), torch.randn(64, 24), torch.randn(64, 48)
    _, graphs, report = _compiled_grads(model, x, gy)
    rows = report.select(path="saved")
    assert [r.decision for r in rows] == [INT8_ROWS, INT8_ROWS] and all(r.saved_bytes_after < r.saved_bytes_before / 3 for r in rows)
    assert [t.dtype for t in graphs.saved() if t.shape == (64, 48)] == [torch.int8, torch.int8]
    xd = x.double()
    outputs = {name: xd @ getattr(model, name).weight.double().T for name in "ab"}
    for name, other in (("a", "b"), ("b", "a")):
        # dW = (gy ⊙ other)ᵀ x, with ``other`` read back within half a level of its row's max.
        exact = (gy.double() * outputs[other]).T @ xd
        level = outputs[other].abs().amax(-1, keepdim=True) * tol.HALF_INT8_LEVEL
        bound = (gy.double().abs() * level).T @ xd.abs() + tol.FP32_VS_REFERENCE * exact.abs().max()
        grad = getattr(model, name).weight.grad.double()
        assert ((grad - exact).abs() <= bound).all(), name
        assert rel_err(grad, exact) > 0


# ------------------------------------------------------------------------------- a whole block


def _block(dtype=torch.float32):
    """A transformer block whose attention heads are 32 wide: rows long enough for a scale each."""
    return models.Block(64, 2).to(dtype)


def _block_step(config: HotConfig, autocast: bool = False, hooks=None):
    torch.manual_seed(0)
    model, x = _block(), torch.randn(2, 20, 64)
    compiled, graphs = aot_compile(model, config)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        with hooks or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = compiled(x)
    out.float().square().mean().backward()
    return model, x, graphs, hot_compile.last_report()


def test_a_block_saves_int8_or_narrower_codes_and_side_information_only():
    saved = []

    def pack(t):
        saved.append(t)
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    model, x, graphs, report = _block_step(HotConfig(**ON), hooks=hooks)
    decisions = {(r.module, r.decision) for r in report.select(path="saved")}
    assert ("mlp.fc1", DERIVATIVE) in decisions and ("attn", INT8_ROWS) in decisions
    assert any("log-sum-exp" in r.reason for r in report.select(path="saved", decision="kept"))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations = [t for t in saved if t.untyped_storage().data_ptr() not in params and t.data_ptr() != x.data_ptr()]
    codes = [t for t in activations if t.dtype in (torch.int8, torch.uint8)]
    floats = [t for t in activations if t.is_floating_point()]
    assert {t.dtype for t in codes} == {torch.int8, torch.uint8} and len(codes) + len(floats) == len(activations)
    # What stays in float: one number per row (scales, a LayerNorm's statistics), per channel (the
    # ABC buffers' scales), and the attention's log-sum-exp (2 × 2 heads × 20 queries).
    lse = (2, 2, 20)
    for t in floats:
        assert t.shape[-1] == 1 or (t.dim() == 2 and t.shape[0] == 1) or tuple(t.shape) == lse, t.shape
    float_bytes = sum(t.numel() * t.element_size() for t in floats)
    code_bytes = sum(t.numel() * t.element_size() for t in codes)
    print(f"saved: {code_bytes} B of codes, {float_bytes} B of float side information")


def test_a_block_under_autocast_compresses_bf16_activations():
    _, _, graphs, report = _block_step(HotConfig(**ON), autocast=True)
    rows = report.select(path="saved")
    assert {r.dtype for r in rows if r.decision == INT8_ROWS} == {"bfloat16"}
    # The encoder computes GELU's derivative from the bf16 input, in float32.
    (encoder,) = graphs.nodes("forward", torch.ops.hot_compile.encode_derivative.default)
    assert encoder.args[0].meta["val"].dtype == torch.bfloat16 and encoder.args[3] == "gelu"


def test_the_budget_compresses_the_most_bytes_per_second_first():
    cost = lambda saved_mib, ms: SiteCost(0.0, ms / 1e3, saved_bytes_before=(saved_mib + 1) << 20, saved_bytes_after=1 << 20)
    values = [types.SimpleNamespace(name=n, reason=None) for n in "abcd"]
    # Bytes per ms: a 4, b 1, c 8, d 2; a 5 ms budget takes c (1 ms), a (2 ms), d (2 ms), not b.
    keep_over_budget(list(zip(values, [cost(8, 2), cost(4, 4), cost(8, 1), cost(4, 2)])), 5e-3, "over")
    assert [v.reason for v in values] == [None, "over", None, None]


def _saved_under_balanced(max_slowdown: float):
    floors = []
    with mock.patch.object(hot_passes, "step_floor", lambda *args: floors.append(step_floor(*args)) or floors[-1]):
        _, _, _, report = _block_step(HotConfig(strict=True, compress_saved=True, max_slowdown=max_slowdown))
    rows = report.select(path="saved")
    products_ms = sum(r.est_ms or 0.0 for r in report.products())
    (floor_s,) = floors
    return [r for r in rows if r.decision != "kept"], [r for r in rows if "over the budget" in r.reason], products_ms, floor_s * 1e3


def test_balanced_compresses_within_max_slowdown_of_the_step_floor():
    decided = {m: _saved_under_balanced(m) for m in (0.1, 5.0)}
    for max_slowdown, (compressed, over, products_ms, floor_ms) in decided.items():
        # The block's attention and the traffic of what its forward saves count beside its products.
        assert over and floor_ms > products_ms
        spent, budget = sum(r.est_hot_ms for r in compressed), max_slowdown * floor_ms
        assert spent <= budget
        # Each value kept over the budget would have overrun it, after the ones that save more per ms.
        assert all(spent + r.est_hot_ms > budget and f"{floor_ms:.3g} ms" in r.reason for r in over)
        assert all(r.saved_bytes_after == r.saved_bytes_before for r in over)
    assert len(decided[0.1][0]) < len(decided[5.0][0])


def test_a_site_is_estimated_as_it_runs():
    row = SiteRow(module="fc", path="gx", shape="-", dtype="float32", decision="kept", reason="-", est_original_ms=2.0, est_hot_ms=3.0)
    assert row.est_ms == 2.0 and dataclasses.replace(row, decision="HQ").est_ms == 3.0


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"policy": "off"}, "policy='off'"),
        ({"policy": "speed"}, "policy='speed'"),
        ({"compress_saved": False, "overrides": {"mlp.*": {"compress_saved": True}}}, "compress_saved=False"),
        ({"include": ("nothing",)}, "excluded by include/exclude globs"),
    ],
)
def test_options_that_keep_the_saved_activations(options, reason):
    config = HotConfig(**{**ON, **options})
    _, _, graphs, report = _block_step(config)
    rows = report.select(path="saved")
    kept = [r for r in rows if r.reason.startswith(reason)]
    assert kept and all(r.decision == "kept" for r in rows if not r.module.startswith("mlp."))
    assert not [t for t in graphs.saved() if t.dtype == torch.int8 and t.dim() == 4]  # attention's q, k, v, out


def test_compress_saved_is_the_default_and_off_saves_what_the_partitioner_chose_with_no_row():
    _, _, graphs, report = _block_step(HotConfig(strict=True, policy="hot"))
    assert report.select(path="saved", decision=DERIVATIVE) and report.select(path="saved", decision=INT8_ROWS)
    _, _, graphs, report = _block_step(HotConfig(strict=True, policy="hot", compress_saved=False))
    assert report.rewritten() and not report.select(path="saved")
    assert not [t for t in graphs.saved() if t.dtype == torch.uint8]


def test_gradients_of_a_block_with_every_activation_compressed():
    model, x, _, report = _block_step(HotConfig(**ON, **EXACT_PRODUCTS))
    assert report.select(path="saved", decision=DERIVATIVE) and report.select(path="saved", decision=INT8_ROWS)
    reference = _block(torch.float64)
    reference.load_state_dict(model.state_dict())
    reference(x.double()).square().mean().backward()
    worst = max(
        rel_err(p.grad, ref.grad) for p, ref in zip(model.parameters(), reference.parameters()) if ref.grad.norm() > 1e-9
    )
    print(f"block, products exact: worst relative gradient error {worst:.4f}")
    assert 0 < worst < tol.E2E_GRAD_SAVED_CODES


def test_an_attention_mask_computed_in_the_graph_stays_exact():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 32)

        def forward(self, x):
            scores = x @ x.transpose(-1, -2)
            mask = torch.zeros_like(scores).masked_fill(scores < 0, float("-inf")).unsqueeze(1)
            q = self.proj(x).view(2, 20, 2, 16).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()

    torch.manual_seed(0)
    compiled, _ = aot_compile(Masked(), HotConfig(**ON))
    compiled(torch.randn(2, 20, 32)).backward()
    rows = hot_compile.last_report().select(path="saved")
    assert any("attention mask" in r.reason for r in rows)
    assert all(math.isfinite(p.grad.abs().sum()) for p in compiled.parameters())


# ------------------------------------------------------------------- through Inductor, the backend


def test_the_backend_compresses_and_a_failure_leaves_the_partition_as_it_was(monkeypatch):
    torch.manual_seed(0)
    model, x = _block(), torch.randn(2, 20, 64)
    compiled = torch.compile(model, backend="hot", options={"policy": "hot", "compress_saved": True})
    compiled(x).square().mean().backward()
    assert hot_compile.last_report().select(path="saved", decision=DERIVATIVE)

    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(hot_compile.inductor_pass, "run_saved_pass", fail)
    torch._dynamo.reset()
    with torch._inductor.utils.fresh_cache(), pytest.warns(HotPassWarning, match="saved as the partitioner chose"):
        compiled = torch.compile(model, backend="hot", options={"policy": "hot", "compress_saved": True})
        compiled(x).square().mean().backward()
    assert not hot_compile.last_report().select(path="saved") and hot_compile.last_report().rewritten()


def test_a_users_partitioner_runs_before_the_compression():
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class Counting(CustomPartitionerFn):
        calls = 0

        def __call__(self, gm, joint_inputs, **kwargs):
            Counting.calls += 1
            return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

        def uuid(self):
            return b"counting"

    torch.manual_seed(0)
    model, x = LinearThen(F.gelu), torch.randn(8, 24)
    compiled = torch.compile(model, backend="hot", options={"policy": "hot", "compress_saved": True, "custom_partitioner_fn": Counting()})
    compiled(x).sum().backward()
    assert Counting.calls == 1 and hot_compile.last_report().select(path="saved", decision=DERIVATIVE)


def test_dynamic_shapes_compress_too():
    torch.manual_seed(0)
    model = _block()
    compiled, _ = aot_compile(model, HotConfig(**ON), dynamic=True)
    for tokens in (20, 28):
        compiled(torch.randn(2, tokens, 64)).square().mean().backward()
    assert hot_compile.last_report().select(path="saved", decision=INT8_ROWS)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
