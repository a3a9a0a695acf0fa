"""The HOT pass on real joint graphs through AOTAutograd (no Inductor codegen)."""

import importlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot_compile
from hot_compile import HotConfig
from hot_compile.inductor_pass import HotJointPass
from hot_compile.passes import provenance
from tests import tolerances as tol
from tests.data import make
from tests.harness import aot_compile, pin_int8_path
from tests.models import MLP, Block, grad_errors

aten = torch.ops.aten
hot_ops = torch.ops.hot_compile
# The product rewrites alone: the saved activations' pass has tests of its own.
STRICT = HotConfig(strict=True, policy="hot", compress_saved=False)


def _smooth(batch, tokens, dim, seed=0):
    return make("smooth", batch * tokens, dim, seed).reshape(batch, tokens, dim)


def _rows(path=None, decision=None):
    return hot_compile.last_report().select(path=path, decision=decision)


def _run(model, x, config=STRICT):
    compiled, graphs = aot_compile(model, config)
    compiled(x).square().mean().backward()
    return graphs


@pytest.mark.parametrize("shape", [(200, 32), (4, 50, 32), (2, 2, 50, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_every_linear_gets_gx_and_gw(shape, bias):
    x = torch.randn(*shape, requires_grad=True)
    graphs = _run(MLP(bias=bias), x)
    assert {(r.module, r.path, r.decision) for r in hot_compile.last_report()} == {
        ("fc1", "fwd", "HQ"),
        ("fc1", "gx", "HQ"),
        ("fc1", "gw", "HLA+ABC"),
        ("fc2", "fwd", "HQ"),
        ("fc2", "gx", "HQ"),
        ("fc2", "gw", "HLA+ABC"),
    }
    assert len(graphs.nodes("backward", hot_ops.hq_grad_input.default)) == 2
    assert len(graphs.nodes("backward", hot_ops.hla_grad_weight.default)) == 2
    assert len(graphs.nodes("forward", hot_ops.compress_activation.default)) == 2
    assert len(graphs.nodes("forward", hot_ops.int8_linear.default)) == 2
    assert not graphs.nodes("backward", aten.mm.default)


def test_functional_linear_and_module_paths():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(24, 32) / 6)
            self.layers = nn.ModuleList([nn.Linear(24, 24) for _ in range(2)])

        def forward(self, x):
            x = F.linear(x, self.w)
            for layer in self.layers:
                x = layer(x).relu()
            return x

    _run(Net(), torch.randn(3, 40, 32))
    print(hot_compile.last_report().table())
    assert {r.module for r in hot_compile.last_report()} == {"", "layers.0", "layers.1"}
    # Three forwards and their backward products, but the first layer's input has no grad: no gx.
    assert len(hot_compile.last_report()) == 8


def test_input_without_grad_and_frozen_weight():
    model = MLP()
    model.fc2.weight.requires_grad_(False)
    _run(model, torch.randn(4, 50, 32))
    rows = {(r.module, r.path) for r in hot_compile.last_report()}
    assert rows == {("fc1", "fwd"), ("fc1", "gw"), ("fc2", "fwd"), ("fc2", "gx")}
    assert model.fc1.weight.grad is not None and model.fc2.weight.grad is None


def test_transformer_block_leaves_attention_alone():
    graphs = _run(Block(), _smooth(2, 40, 32))
    assert len(_rows("gw", "HLA+ABC")) == 4 and len(_rows("gx", "HQ")) == 4  # qkv, proj, fc1, fc2
    # attention products stay batched float matmuls
    bmms = graphs.nodes("backward", aten.bmm.default)
    assert bmms and all(n.meta["val"].dtype == torch.float32 for n in bmms)
    assert len([v for v in graphs.saved() if v.dtype == torch.int8]) == 4


class _SeparateQKV(torch.nn.Module):
    """Three linears reading one input, as separate q, k and v projections do."""

    def __init__(self, dim=32):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        return self.q(x) * self.k(x).sigmoid() + self.v(x)


def test_linears_of_one_input_share_its_compressed_buffer():
    graphs = _run(_SeparateQKV(), _smooth(2, 40, 32))
    assert len(_rows("gw", "HLA+ABC")) == 3
    assert len([v for v in graphs.saved() if v.dtype == torch.int8]) == 1


@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("tokens", [197, 6272])
def test_abc_keeps_at_most_rank_64ths_of_the_fp32_input_at_any_length(tokens, rank):
    """An eighth at rank 8, a quarter at rank 16 (int8 without the low-rank cut)."""
    graphs = _run(MLP(32, 64, 32), torch.randn(1, tokens, 32), STRICT.replace(rank=rank))
    int8 = [v for v in graphs.saved() if v.dtype == torch.int8]
    assert len(int8) == 2 and all(v.numel() <= tokens * v.shape[1] * 4 * rank / 64 for v in int8)


@pytest.mark.parametrize("rank", [8, 16])
def test_abc_saves_int8_and_no_float_input(rank):
    graphs = _run(MLP(32, 256, 32), torch.randn(8, 96, 32), STRICT.replace(rank=rank))
    saved = graphs.saved()
    int8 = [v for v in saved if v.dtype == torch.int8]
    rows = 768 * rank // 16
    assert sorted(tuple(v.shape) for v in int8) == [(rows, 32), (rows, 256)]
    # fc2's input (the GELU output, 768×256) is not saved; fc1's GELU input is (GELU backward needs it)
    float_acts = [tuple(v.shape) for v in saved if v.dtype == torch.float32 and v.dim() == 2 and v.shape[0] == 768]
    assert float_acts == [(768, 256)]
    for row in _rows("gw"):
        print(f"{row.module}: saved {row.saved_bytes_before} B → {row.saved_bytes_after} B")
        # int8 rows of the low-pass projection plus one float32 scale per channel
        assert row.saved_bytes_after == row.saved_bytes_before * rank // 64 + 4 * row.saved_bytes_before // (768 * 4)


def test_report_names_a_backward_reader_of_x():
    class GatedNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 64)

        def forward(self, x):
            h = self.fc1(x).relu()
            return self.fc2(h) * h  # mul's backward needs h, fc2's input, together with the gradient

    graphs = _run(GatedNet(), torch.randn(64, 16))
    (fc2,) = [r for r in _rows("gw") if r.module == "fc2"]
    assert "still read by backward" in fc2.reason and fc2.saved_bytes_after > fc2.saved_bytes_before
    assert (64, 64) in [tuple(v.shape) for v in graphs.saved() if v.dtype == torch.float32]
    # ReLU alone does not keep it: its backward mask is computed in the forward
    (fc1,) = [r for r in _rows("gw") if r.module == "fc1"]
    assert "still read" not in fc1.reason


def test_every_created_node_has_provenance_and_metadata():
    graphs = _run(MLP(), torch.randn(4, 50, 32))
    created = [n for n in graphs.joint.graph.nodes if provenance.META_KEY in n.meta]
    assert created
    for node in created:
        assert "val" in node.meta
        info = node.meta[provenance.META_KEY]
        assert info["rewrite"] in ("int8_linear", "hq_grad_input", "hla_grad_weight", "compress_activation")
        assert info["module"] in ("fc1", "fc2") and info["path"] in ("fwd", "gx", "gw")


@pytest.mark.parametrize(
    "config,kept",
    [
        (STRICT.replace(policy="off"), 6),
        (STRICT.replace(exclude=("fc2",)), 3),
        (STRICT.replace(include=("fc2",)), 3),
        (STRICT.replace(rewrite_gx=False), 2),
        (STRICT.replace(rewrite_gw=False), 2),
    ],
)
def test_policy_off_and_globs_keep_sites(config, kept):
    graphs = _run(MLP(), torch.randn(4, 50, 32, requires_grad=True), config)
    assert len(_rows(decision="kept")) == kept
    kept_forwards = len(_rows(path="fwd", decision="kept"))
    assert len(graphs.nodes("backward", aten.mm.default)) == kept - kept_forwards
    assert len(graphs.nodes("forward", hot_ops.int8_linear.default)) == 2 - kept_forwards


def test_grad_weight_of_a_single_token_is_kept_at_rank_8():
    """Rank 8 keeps one row per pair of tokens, none of a lone one: HLA would return zeros."""
    _run(MLP(), torch.randn(1, 32, requires_grad=True), STRICT.replace(rank=8))
    assert {r.decision for r in _rows(path="gx")} == {"HQ"}
    gw = _rows(path="gw")
    assert len(gw) == 2 and all(r.decision == "kept" and "keeps no row of L = 1 tokens" in r.reason for r in gw)


def test_float64_linear_is_kept_with_reason():
    _run(MLP().double(), torch.randn(4, 50, 32, dtype=torch.float64, requires_grad=True))
    rows = hot_compile.last_report().rows
    assert rows and all(r.decision == "kept" and "float64" in r.reason for r in rows)


@pytest.mark.parametrize(
    "config,numerics",
    [
        (STRICT, "g per_token, W per_channel"),
        (STRICT.replace(weight_quantizer="stochastic"), "g per_token, W stochastic"),
        (STRICT.replace(gw_quantizer="per_tensor"), "g per_token, W per_channel"),
    ],
)
def test_grads_within_band_full_rank(config, numerics):
    torch.manual_seed(0)
    model = Block()
    compiled, _ = aot_compile(model, config)
    errors = grad_errors(model, compiled, torch.randn(2, 48, 32))
    print({k: round(v, 3) for k, v in errors.items()})
    assert max(errors.values()) < tol.E2E_GRAD
    hq, hla = _rows("gx", "HQ"), _rows("gw", "HLA+ABC")
    assert len(hq) == len(hla) == 4
    assert all(r.numerics.endswith(numerics) and r.numerics.startswith("INT") for r in hq)
    assert all(r.numerics.endswith(f"rank 16 {config.gw_quantizer}") for r in hla)


def test_grads_within_band_rank_8_on_token_smooth_input():
    torch.manual_seed(0)
    model = MLP()
    compiled, _ = aot_compile(model, STRICT.replace(rank=8))
    errors = grad_errors(model, compiled, _smooth(4, 64, 32))
    print({k: round(v, 3) for k, v in errors.items()})
    assert max(errors.values()) < tol.E2E_GRAD_RANK8_SMOOTH
    assert len(_rows("gw", "HLA+ABC")) == 2 and len(_rows("gx", "HQ")) == 1


class _FailingPass(HotJointPass):
    """Fails after the first rewrite inserted its nodes: exercises the roll-back."""

    def __call__(self, graph):
        module = importlib.import_module("hot_compile.runtime.ops")
        original = module.compress_activation
        calls = []

        def fail_on_second(*args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("injected failure")
            return original(*args, **kwargs)

        module.compress_activation = fail_on_second
        try:
            before = [n.format_node() for n in graph.nodes]
            super().__call__(graph)
            self.unchanged = before == [n.format_node() for n in graph.nodes]
        finally:
            module.compress_activation = original


def test_pass_failure_leaves_graph_unchanged_and_warns():
    model = MLP()
    compiled, graphs = aot_compile(model, HotConfig(policy="hot"), pass_cls=_FailingPass)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(4, 50, 32)).sum().backward()
    messages = [str(w.message) for w in caught if issubclass(w.category, hot_compile.HotPassWarning)]
    assert len(messages) == 1 and "injected failure" in messages[0]
    assert graphs.hot_pass.unchanged
    assert len(graphs.nodes("backward", aten.mm.default)) == 3  # the input needs no grad: no fc1 gx
    assert model.fc1.weight.grad is not None


def test_pass_failure_raises_when_strict():
    compiled, _ = aot_compile(MLP(), STRICT, pass_cls=_FailingPass)
    with pytest.raises(Exception, match="injected failure"):
        compiled(torch.randn(4, 50, 32)).sum().backward()


def test_every_integer_gemm_gives_the_same_gradients(monkeypatch):
    """Where ``torch._int_mm`` has no hardware the integer products run on oneDNN's uint8 × int8 GEMM
    or as exact float GEMMs: same integers, so the same gradients bit for bit. At 7 bits, the width
    the defaults take on such CPUs, grad_input runs on the uint8 × int8 GEMM."""
    from hot_compile.runtime import int8_gemm

    u8s8_calls = []
    u8s8_linear = int8_gemm.u8s8_linear
    monkeypatch.setattr(int8_gemm, "u8s8_linear", lambda *args: u8s8_calls.append(1) or u8s8_linear(*args))
    grads = {}
    for kind in ("int_mm", "u8s8", "float"):
        pin_int8_path(monkeypatch, kind)
        torch.manual_seed(0)
        model, x = MLP(), torch.randn(4, 50, 32, requires_grad=True)
        _run(model, x, STRICT.replace(gx_bits=7))
        assert len(_rows("gx", "HQ")) == 2
        grads[kind] = [x.grad, *(p.grad for p in model.parameters())]
        assert bool(u8s8_calls) == (kind != "int_mm")  # HQ's 7-bit products on the u8s8 GEMM from then on
    assert all(torch.equal(a, b) for a, b in zip(grads["int_mm"], grads["u8s8"]))
    assert all(torch.equal(a, b) for a, b in zip(grads["int_mm"], grads["float"]))


@pytest.mark.parametrize(
    "kind,gx_bits,note",
    [("int_mm", 8, None), ("u8s8", 4, "GEMM: oneDNN uint8 × int8"), ("u8s8", 8, "GEMM: float32"), ("float", 4, "GEMM: float32")],
)
def test_rows_name_a_gemm_other_than_the_int8_one(monkeypatch, kind, gx_bits, note):
    pin_int8_path(monkeypatch, kind)
    _run(MLP(), torch.randn(4, 50, 32, requires_grad=True), STRICT.replace(gx_bits=gx_bits))
    (fc1,) = [r for r in _rows("gx", "HQ") if r.module == "fc1"]
    assert "GEMM" not in fc1.numerics if note is None else note in fc1.numerics
