"""The attention backward under bf16 autocast: as products of the scores, or in float32, where the device
profile says the bf16 kernel is the slower one (:mod:`hot_compile.passes.attention_precision`), with a
row either way; and its mask, saved for it, kept exact."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import hot_compile
from hot_compile import HotConfig
from hot_compile.passes import attention_precision
from hot_compile.passes.attention_precision import FLASH_CPU_BACKWARD
from hot_compile.passes.saved_activations import attention_masks, why_kept
from tests import tolerances as tol
from tests.harness import aot_compile
from tests.models import gradient_errors

FLOAT32_BACKWARD = "cpu-avx2-2core"  # fp32_attention_backward alone
PRODUCTS_BACKWARD = "cpu-zen4-2core"  # attention_backward_products too
FAST_BF16 = "cpu-generic"  # neither


class AttentionOnly(nn.Module):
    """Self-attention whose q, k and v are per-channel scalings of the input: no linear product, so the
    attention is the only site."""

    def __init__(self, dim=32, heads=2, mask=None, causal=False):
        super().__init__()
        self.heads, self.mask, self.causal = heads, mask, causal
        self.scales = nn.Parameter(1 + 0.1 * torch.randn(3, dim))

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = ((x * s).view(b, l, self.heads, -1).transpose(1, 2) for s in self.scales)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.causal).transpose(1, 2).reshape(b, l, d)


def _bf16_step(profile: str, policy: str = "hot", mask=None, causal=False):
    torch.manual_seed(0)
    model, x = AttentionOnly(mask=mask, causal=causal), torch.randn(4, 40, 32)
    compiled, graphs = aot_compile(model, HotConfig(strict=True, policy=policy, device_profile=profile))
    with torch.autocast("cpu", torch.bfloat16):
        out = compiled(x)
    out.float().square().mean().backward()
    reference = AttentionOnly(mask=mask if mask is None or mask.dtype == torch.bool else mask.double(), causal=causal).double()
    reference.load_state_dict(model.state_dict())
    reference(x.double()).square().mean().backward()
    return gradient_errors(model, reference)["scales"], graphs, hot_compile.last_report()


def test_attention_backward_runs_in_float32_where_bf16_is_slower():
    error, graphs, report = _bf16_step(FLOAT32_BACKWARD)
    (row,) = report.select(path="attn")
    assert row.decision == "float32" and row.dtype == "bfloat16" and row.shape == "4×2×40×16"
    (backward,) = graphs.nodes("backward", FLASH_CPU_BACKWARD)
    assert {a.meta["val"].dtype for a in backward.args[:5]} == {torch.float32}
    kept_error, graphs, report = _bf16_step(FAST_BF16)
    assert report.select(path="attn", decision="kept") and "not the slower one" in report.rows[0].reason
    assert [a.meta["val"].dtype for a in graphs.nodes("backward", FLASH_CPU_BACKWARD)[0].args[:5]] == [torch.bfloat16] * 5
    # The same function computed in float32: as exact as the bf16 kernel up to one bf16 rounding of
    # the gradients (both carry the forward's bf16 rounding).
    print(f"attention gradient error: float32 backward {error:.5f}, bf16 backward {kept_error:.5f}")
    assert error <= kept_error + tol.BF16_ROUNDING


def test_attention_backward_runs_as_products_where_they_are_faster(monkeypatch):
    monkeypatch.setattr(attention_precision, "MIN_PRODUCTS_WORK", 0)  # the model's attention is a small one
    error, graphs, report = _bf16_step(PRODUCTS_BACKWARD)
    (row,) = report.select(path="attn")
    assert row.decision == "products" and row.shape == "4×2×40×16" and "bf16" in row.numerics
    assert not graphs.nodes("backward", FLASH_CPU_BACKWARD)
    (products,) = graphs.nodes("backward", torch.ops.hot_compile.attention_backward.default)
    assert [a.meta["val"].dtype for a in products.args[:5]] == [torch.bfloat16] * 5
    assert products.meta["hot_compile"]["rewrite"] == "attention_backward_products"
    kept_error, _, _ = _bf16_step(FAST_BF16)
    # P and dS rounded to bf16 where they enter the products, as the bf16 kernel rounds them.
    print(f"attention gradient error: products {error:.5f}, bf16 backward {kept_error:.5f}")
    assert error <= kept_error + tol.BF16_ROUNDING


def test_a_small_attention_backward_keeps_the_fused_kernel():
    _, graphs, report = _bf16_step(PRODUCTS_BACKWARD)
    (row,) = report.select(path="attn", decision="float32")
    assert f"B·H·L·S·E = {4 * 2 * 40 * 40 * 16} under" in row.reason
    assert graphs.nodes("backward", FLASH_CPU_BACKWARD)


@pytest.mark.parametrize("kind", ["bool", "additive", "causal"])
def test_masked_attention_backward_runs_in_float32(kind):
    gen = torch.Generator().manual_seed(0)
    mask = {"bool": torch.rand(40, 40, generator=gen) > 0.2, "additive": torch.randn(4, 1, 40, 40, generator=gen)}.get(kind)
    error, graphs, report = _bf16_step(PRODUCTS_BACKWARD, mask=mask, causal=kind == "causal")
    kept_error, _, _ = _bf16_step(FAST_BF16, mask=mask, causal=kind == "causal")
    (row,) = report.select(path="attn", decision="float32")
    assert ("causal" if kind == "causal" else "attention mask") in row.reason
    (backward,) = graphs.nodes("backward", FLASH_CPU_BACKWARD)
    if mask is not None:
        assert backward.kwargs["attn_mask"].meta["val"].dtype in (torch.float32, torch.bool)
    print(f"masked attention gradient error: float32 backward {error:.5f}, bf16 backward {kept_error:.5f}")
    assert error <= kept_error + tol.BF16_ROUNDING


@pytest.mark.parametrize("config", [dict(policy="off"), dict(policy="hot", exclude=["*"])])
def test_policy_off_and_globs_keep_the_attention_backward(config):
    torch.manual_seed(0)
    compiled, _ = aot_compile(AttentionOnly(), HotConfig(strict=True, device_profile=PRODUCTS_BACKWARD, **config))
    with torch.autocast("cpu", torch.bfloat16):
        compiled(torch.randn(2, 8, 32)).float().sum().backward()
    (row,) = hot_compile.last_report().select(path="attn")
    assert row.decision == "kept" and ("policy='off'" in row.reason or "globs" in row.reason)


def test_float32_attention_has_no_row():
    compiled, _ = aot_compile(AttentionOnly(), HotConfig(strict=True, policy="hot", device_profile=PRODUCTS_BACKWARD))
    compiled(torch.randn(2, 8, 32)).sum().backward()
    assert not hot_compile.last_report().select(path="attn")


def test_a_saved_mask_read_through_a_cast_stays_exact():
    """The float32 backward reads an upcast mask: saved in bf16, the mask reaches the attention through
    the cast. Coded in int8 rows, a row holding -inf would decode to NaN (0 times an infinite scale)."""
    graph = fx.Graph()
    grad, q, k, v, out, lse, mask = (graph.placeholder(name) for name in ("grad", "q", "k", "v", "out", "lse", "mask"))
    mask.meta["val"] = torch.zeros(4, 1, 40, 40, dtype=torch.bfloat16)
    upcast = graph.call_function(torch.ops.prims.convert_element_type.default, (mask, torch.float32))
    graph.call_function(FLASH_CPU_BACKWARD, (grad, q, k, v, out, lse, 0.0, False), {"attn_mask": upcast})
    reason = why_kept(mask, mask, inner_outputs=set(), weight_like=lambda node: False, masks=attention_masks(graph))
    assert reason is not None and "attention mask" in reason
