"""Convolutions: HOT's backward products over the im2col matrix (groups = 1), the numerics of their ops
against float64, and the pass on ResNet-style stacks. Each end-to-end test asserts what was rewritten
(rows, the ops in the backward graph) and what was kept, and why."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hot_compile
from hot_compile import HotConfig
from hot_compile.passes.cost_model import conv_grad_input_cost, conv_grad_weight_cost, grad_input_cost, grad_weight_cost
from hot_compile.runtime import conv_ops, ops
from hot_compile.runtime.devices import BUILTIN_PROFILES
from tests import tolerances as tol
from tests.data import rel_err
from tests.harness import aot_compile
from tests.models import grad_errors

aten = torch.ops.aten
hot = torch.ops.hot_compile
SEED = torch.tensor(7)
STRICT = HotConfig(strict=True, policy="hot")
# (stride, padding, dilation): what ResNets use, and the less common ones the fold must get right.
GEOMETRIES = [((1, 1), (1, 1), (1, 1)), ((2, 2), (1, 1), (1, 1)), ((1, 1), (2, 2), (2, 2)), ((2, 1), (0, 1), (1, 1))]
HQ_SETTINGS = dict(grad_bits=8, weight_bits=8, per_token=True, hadamard=True, weight_quantizer="per_channel")


def _conv_operands(stride, padding, dilation, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, 13, 11, generator=gen, dtype=torch.float64)
    w = torch.randn(24, 8, 3, 3, generator=gen, dtype=torch.float64) / 72**0.5
    g = torch.randn_like(F.conv2d(x, w, None, stride, padding, dilation), dtype=torch.float64)
    return x, w, g


def _exact(x, w, g, stride, padding, dilation):
    """(grad_input, grad_weight) in float64."""
    return aten.convolution_backward(g, x, w, None, stride, padding, dilation, False, [0, 0], 1, [True, True, False])[:2]


def _hq(g, w, seed, x_shape, stride, padding, dilation):
    return conv_ops.conv_hq_grad_input(g, w, seed, list(x_shape[2:]), list(stride), list(padding), list(dilation), *HQ_SETTINGS.values())


def _hla(g, x, seed, stride, padding, dilation, rank=16):
    x_q, x_scale = conv_ops.compress_conv_input(x, 8)
    return conv_ops.conv_hla_grad_weight(g, x_q, x_scale, seed, [3, 3], list(stride), list(padding), list(dilation), rank, 8, True, g.dtype)


# ------------------------------------------------------------------------------------------ the ops


@pytest.mark.parametrize("stride, padding, dilation", GEOMETRIES)
def test_conv_ops_are_the_linear_ops_over_the_patch_matrix(stride, padding, dilation):
    """The ops against HQ and HLA on the patch matrix that ``F.unfold`` builds and ``F.fold`` sums."""
    x, w, g = (t.float() for t in _conv_operands(stride, padding, dilation))
    (b, cout, ho, wo), (cin, kh, kw) = g.shape, w.shape[1:]

    def to_kernel_major(unfolded):  # F.unfold's columns (Cin, kh, kw) → the ops' (kh, kw, Cin)
        return unfolded.view(b, cin, kh, kw, ho * wo).permute(0, 4, 2, 3, 1).reshape(b * ho * wo, -1)

    tokens = g.permute(0, 2, 3, 1).reshape(-1, cout)
    patches = ops.hq_grad_input(tokens, w.permute(0, 2, 3, 1).reshape(cout, -1), SEED, *HQ_SETTINGS.values())
    patches = patches.view(b, ho * wo, kh, kw, cin).permute(0, 4, 2, 3, 1).reshape(b, cin * kh * kw, ho * wo)
    folded = F.fold(patches, x.shape[2:], (kh, kw), dilation, padding, stride)
    torch.testing.assert_close(_hq(g, w, SEED, x.shape, stride, padding, dilation), folded)  # sums in another order

    x_q, x_scale = conv_ops.compress_conv_input(x, 8)
    cols = to_kernel_major(F.unfold(x_q.float() * x_scale, (kh, kw), dilation, padding, stride))
    linear = ops.hla_grad_weight(tokens, *ops.compress_activation(cols, 16, 8, True), SEED, 16, 8, True, torch.float32)
    assert torch.equal(_hla(g, x, SEED, stride, padding, dilation), linear.view(cout, kh, kw, cin).permute(0, 3, 1, 2))


@pytest.mark.parametrize("stride, padding, dilation", GEOMETRIES)
def test_conv_ops_against_float64(stride, padding, dilation):
    x, w, g = _conv_operands(stride, padding, dilation)
    exact_gx, exact_gw = _exact(x, w, g, stride, padding, dilation)
    gx = _hq(g.float(), w.float(), SEED, x.shape, stride, padding, dilation)
    gw = _hla(g.float(), x.float(), SEED, stride, padding, dilation)
    print(f"conv {stride} {padding} {dilation}: grad_input {rel_err(gx, exact_gx):.4f}, grad_weight {rel_err(gw, exact_gw):.4f}")
    assert rel_err(gx, exact_gx) < tol.INT8_PER_SLICE_PRODUCT
    assert rel_err(gw, exact_gw) < tol.CONV_HLA_PRODUCT


@pytest.mark.parametrize("window_bytes, rows", [(1, 1), (4000, 2)])
def test_windowed_conv_ops_against_float64(monkeypatch, window_bytes, rows):
    """Split into windows of one output row, or of two (the last one cut at the image's edge), the
    ops stay within the bounds of one product: a window never holds a large layer's whole patch matrix."""
    monkeypatch.setattr(conv_ops, "WINDOW_BYTES", window_bytes)
    stride, padding, dilation = GEOMETRIES[1]
    x, w, g = _conv_operands(stride, padding, dilation)
    exact_gx, exact_gw = _exact(x, w, g, stride, padding, dilation)
    windows = list(conv_ops._windows(g.shape[0], *g.shape[2:], 9 * 8 * 4))  # rows of 6 tokens, 288 B each
    assert len(windows) == g.shape[0] * -(-g.shape[2] // rows)
    assert rel_err(_hq(g.float(), w.float(), SEED, x.shape, stride, padding, dilation), exact_gx) < tol.INT8_PER_SLICE_PRODUCT
    assert rel_err(_hla(g.float(), x.float(), SEED, stride, padding, dilation), exact_gw) < tol.CONV_HLA_PRODUCT


def test_conv_hq_is_unbiased_over_draws():
    stride, padding, dilation = GEOMETRIES[1]
    x, w, g = _conv_operands(stride, padding, dilation)
    exact = _exact(x, w, g, stride, padding, dilation)[0]
    draws = (_hq(g.float(), w.float(), torch.tensor(s), x.shape, stride, padding, dilation) for s in range(tol.UNBIASED_DRAWS))
    mean = sum(d.double() for d in draws) / tol.UNBIASED_DRAWS
    print(f"conv HQ, mean of {tol.UNBIASED_DRAWS} draws: rel err {rel_err(mean, exact):.4f}")
    assert rel_err(mean, exact) < tol.UNBIASED_MEAN


def test_compress_conv_input_is_int8_within_half_a_level_per_channel():
    x = torch.randn(3, 5, 7, 6) * torch.tensor([1e-3, 1.0, 10.0, 0.0, 3.0]).view(1, 5, 1, 1)
    x_q, scale = conv_ops.compress_conv_input(x, 8)
    assert x_q.dtype == torch.int8 and x_q.shape == x.shape and scale.shape == (1, 5, 1, 1)
    assert (x_q.float() * scale - x).abs().le(scale / 2 * (1 + 1e-6)).all()
    assert x_q.abs().amax(dim=(0, 2, 3)).tolist() == [127, 127, 127, 0, 127]  # each channel its own scale


def test_conv_ops_pass_opcheck():
    stride, padding, dilation = GEOMETRIES[1]
    x, w, g = (t.float() for t in _conv_operands(stride, padding, dilation))
    x_q, x_scale = conv_ops.compress_conv_input(x, 8)
    geometry = (list(stride), list(padding), list(dilation))
    torch.library.opcheck(conv_ops.conv_hq_grad_input, (g, w, SEED, list(x.shape[2:]), *geometry, *HQ_SETTINGS.values()))
    torch.library.opcheck(conv_ops.conv_hla_grad_weight, (g, x_q, x_scale, SEED, [3, 3], *geometry, 16, 8, True, torch.float32))


def test_conv_costs_add_the_patch_traffic_to_the_linear_ones():
    profile = BUILTIN_PROFILES["cpu-zen4-2core"]
    t, n, k, in_shape = 32 * 56 * 56, 64, 64 * 9, (32, 64, 56, 56)
    in_elems = 32 * 64 * 56 * 56
    flops = profile.matmul_rate(torch.float32)
    gx = conv_grad_input_cost(t, n, k, in_elems, 9, 4, flops, profile, 8)
    gw = conv_grad_weight_cost(t, n, k, in_shape, 16, 4, flops, profile, 8)
    # The fold, the unfold and the forward's compression are each a pass over T·K or the input.
    assert gx.hot_s > grad_input_cost(t, n, k, 4, flops, profile, 8).hot_s + t * k * 4 / profile.read_bw
    assert gw.hot_s > grad_weight_cost(t, n, k, 16, 4, flops, profile, 8).hot_s + t * k * 4 / profile.write_bw
    # A direct convolution writes the input's size, not the patches'.
    assert gx.original_s < grad_input_cost(t, n, k, 4, flops, profile, 8).original_s
    assert (gw.saved_bytes_before, gw.saved_bytes_after) == (4 * in_elems, in_elems + 4 * 64)


# ------------------------------------------------------------------------------------------ the pass


class Block(nn.Module):
    """A residual block: 3×3 (stride s, no bias), 3×3 (bias), a depthwise 3×3, and a 1×1 shortcut."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.depthwise = nn.Conv2d(cout, cout, 3, 1, 1, groups=cout)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        h = self.depthwise(torch.relu(self.conv2(torch.relu(self.conv1(x)))))
        return torch.relu(h + self.shortcut(x))


def small_resnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), Block(16, 32, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten())


GROUPS_1 = ["0", "2.conv1", "2.conv2", "2.shortcut"]


def test_resnet_gradients_within_bound_and_every_groups_1_product_rewritten():
    model = small_resnet()
    compiled, graphs = aot_compile(model, STRICT)
    errors = grad_errors(model, compiled, torch.randn(8, 3, 16, 16))
    report = hot_compile.last_report()
    print(report.table(), errors)
    rewritten = {(r.module, r.path) for r in report if r.decision != "kept"}
    # The stem's input needs no gradient: it has no grad_input product.
    assert rewritten == {(m, p) for m in GROUPS_1 for p in ("gx", "gw")} - {("0", "gx")}
    backward_ops = [n.target for n in graphs.nodes("backward")]
    assert backward_ops.count(hot.conv_hq_grad_input.default) == 3
    assert backward_ops.count(hot.conv_hla_grad_weight.default) == 4
    assert backward_ops.count(aten.convolution_backward.default) == 1  # the depthwise convolution's
    assert max(errors.values()) < tol.E2E_GRAD_CONV
    assert min(errors[f"{m}.weight"] for m in GROUPS_1) > 0  # quantized, not the exact product
    for row in report.select(path="gw", decision="HLA+ABC"):
        assert row.saved_bytes_after < row.saved_bytes_before / 3  # int8 of float32, a scale per channel


def test_the_forward_saves_int8_inputs_and_one_buffer_per_shared_input():
    model = small_resnet()
    compiled, graphs = aot_compile(model, STRICT)
    compiled(torch.randn(8, 3, 16, 16)).sum().backward()
    saved_int8 = [tuple(v.shape) for v in graphs.saved() if v.dtype == torch.int8]
    # The stem's input, the block's input (its conv1 and shortcut share one buffer) and conv2's input.
    assert sorted(saved_int8) == sorted([(8, 3, 16, 16), (8, 16, 16, 16), (8, 32, 8, 8)])


def test_depthwise_and_grouped_convolutions_are_kept_with_reason():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1, groups=2))
    compiled, graphs = aot_compile(model, STRICT)
    compiled(torch.randn(2, 8, 8, 8, requires_grad=True)).sum().backward()
    rows = [r for r in hot_compile.last_report().products() if r.path != "fwd"]
    assert {(r.module, r.decision) for r in rows} == {("0", "kept"), ("2", "kept")}
    assert all("depthwise" in r.reason for r in rows if r.module == "0")
    assert all("grouped convolution (groups=2)" in r.reason for r in rows if r.module == "2")
    assert [n.target for n in graphs.nodes("backward")].count(aten.convolution_backward.default) == 2


def test_conv1d_is_kept_with_reason():
    model = nn.Sequential(nn.Conv1d(8, 16, 3, padding=1))
    compiled, _ = aot_compile(model, STRICT)
    compiled(torch.randn(2, 8, 20, requires_grad=True)).sum().backward()
    rows = [r for r in hot_compile.last_report() if r.path != "fwd"]
    assert rows and all(r.decision == "kept" and "1-D convolution" in r.reason for r in rows)


def test_symbolic_spatial_size_is_kept_with_reason():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    compiled = torch.compile(model, backend="hot", options={"policy": "hot", "strict": True}, dynamic=True)
    compiled(torch.randn(2, 3, 8, 8)).sum().backward()
    rows = [r for r in hot_compile.last_report().products() if r.path != "fwd"]
    assert len(rows) == 3 and all(r.decision == "kept" and "spatial size is symbolic" in r.reason for r in rows)


@pytest.mark.parametrize("rewritten", ["gx", "gw"])
def test_one_product_rewritten_leaves_the_other_exact(rewritten):
    """With only grad_input rewritten, the convolution_backward computes grad_weight and the bias; with
    only grad_weight, the rest comes from ops that do not read the input, which is saved in int8 only."""
    torch.manual_seed(0)
    # The 1×1 stem (kept by the globs) makes the convolution's input need a gradient; no activation
    # between them, whose backward would read that input.
    model = nn.Sequential(nn.Conv2d(8, 6, 1, bias=False), nn.Identity(), nn.Conv2d(6, 16, 3, stride=2, padding=1))
    only = dict(rewrite_gx=rewritten == "gx", rewrite_gw=rewritten == "gw")
    compiled, graphs = aot_compile(model, HotConfig(strict=True, policy="hot", exclude=["0"], **only))
    x = torch.randn(4, 8, 15, 15)
    errors = grad_errors(model, compiled, x)
    decisions = {r.path: r.decision for r in hot_compile.last_report() if r.module == "2" and r.path != "fwd"}
    assert decisions == {"gx": "HQ" if rewritten == "gx" else "kept", "gw": "HLA+ABC" if rewritten == "gw" else "kept"}
    backward = [n for n in graphs.nodes("backward", aten.convolution_backward.default) if tuple(n.args[2].meta["val"].shape) == (16, 6, 3, 3)]
    if rewritten == "gx":
        assert [n.args[-1] for n in backward] == [[False, True, True]]
        assert errors["2.weight"] < 1e-5
    else:
        assert not backward
        saved = {(v.dtype, tuple(v.shape)) for v in graphs.saved()}
        assert (torch.int8, (4, 6, 15, 15)) in saved and (torch.float32, (4, 6, 15, 15)) not in saved
        assert 0 < errors["2.weight"] < tol.CONV_HLA_PRODUCT
    assert errors["2.bias"] < 1e-5  # the bias gradient is g's sum either way


def test_conv_sites_through_inductor():
    """The real backend: Inductor compiles the rewritten graph, and the gradients stay within bound."""
    model = small_resnet()
    compiled = torch.compile(model, backend="hot", options={"policy": "hot", "strict": True})
    errors = grad_errors(model, compiled, torch.randn(8, 3, 16, 16))
    report = hot_compile.last_report()
    assert {(r.module, r.path) for r in report if r.decision != "kept"} >= {(m, "gw") for m in GROUPS_1}
    assert max(errors.values()) < tol.E2E_GRAD_CONV


def test_dump_covers_conv_sites(tmp_path):
    model = small_resnet()
    config = {"policy": "hot", "strict": True, "dump_dir": str(tmp_path)}
    torch.compile(model, backend="hot", options=config)(torch.randn(2, 3, 8, 8)).sum().backward()
    folder = tmp_path / "0_0"
    after, picture = (folder / "joint_after.py").read_text(), (folder / "backward.svg").read_text()
    for rewrite in ("conv_hq_grad_input", "conv_hla_grad_weight", "compress_conv_input"):
        assert f"'rewrite': '{rewrite}'" in after  # provenance kept in the dump
    assert "conv_hq_grad_input" in picture and "conv_hla_grad_weight" in picture  # the backward region
    rows = json.loads((folder / "report.json").read_text())["rows"]
    assert {(r["module"], r["decision"]) for r in rows if r["path"] == "gw"} == {
        ("0", "HLA+ABC"), ("2.conv1", "HLA+ABC"), ("2.conv2", "HLA+ABC"), ("2.shortcut", "HLA+ABC"), ("2.depthwise", "kept")
    }


def test_rectangular_kernel_dilation_and_channels_last_input():
    """A 3×1 kernel with dilation and unequal strides, on a channels-last input (what a model converted
    with ``memory_format=torch.channels_last`` feeds its convolutions)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 1), nn.Conv2d(8, 16, (3, 1), stride=(1, 2), padding=(2, 0), dilation=(2, 1)))
    compiled, _ = aot_compile(model, STRICT)
    x = torch.randn(4, 8, 12, 9).to(memory_format=torch.channels_last)
    errors = grad_errors(model, compiled, x)
    assert {(r.module, r.path, r.decision) for r in hot_compile.last_report().products() if r.path != "fwd"} == {
        ("0", "gw", "HLA+ABC"), ("1", "gx", "HQ"), ("1", "gw", "HLA+ABC")
    }
    assert max(errors.values()) < tol.E2E_GRAD_CONV
