"""A weight's cast is recomputed in the backward, not saved (:mod:`hot_compile.passes.saved_casts`): what
the forward saves, the gradients bit for bit, the chains that qualify, and the estimate."""

import types

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import hot_compile
from hot_compile import HotConfig
from hot_compile.harness import models
from hot_compile.passes import saved_activations
from hot_compile.passes.cost_model import recompute_cost
from hot_compile.passes.provenance import META_KEY
from hot_compile.passes.saved_activations import RECOMPUTED
from hot_compile.passes.saved_casts import cast_chain
from hot_compile.passes.sites import WeightLike
from hot_compile.runtime.devices import BUILTIN_PROFILES
from tests.harness import aot_compile

ON = dict(strict=True, policy="hot", compress_saved=True)


def _autocast_step(config: HotConfig):
    """One bf16-autocast step of a transformer block; its gradients, graphs, report and saved tensors."""
    torch.manual_seed(0)
    model, x = models.Block(64, 2), torch.randn(2, 20, 64, requires_grad=True)
    compiled, graphs = aot_compile(model, config)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autocast("cpu", torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(x)
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters()] + [x.grad]
    return model, grads, graphs, hot_compile.last_report(), saved


def test_weight_casts_are_recomputed_in_the_backward_not_saved():
    model, _, graphs, report, saved = _autocast_step(HotConfig(**ON))
    rows = report.select(path="saved", decision=RECOMPUTED)
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    assert rows and {tuple(int(d) for d in r.shape.split("×")) for r in rows} <= weights
    assert all(r.dtype == "bfloat16" and r.saved_bytes_after == 0 for r in rows)
    # Nothing of a weight's shape is saved in bf16; the parameters themselves are.
    assert not [t for t in saved if t.dtype == torch.bfloat16 and tuple(t.shape) in weights]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert any(t.untyped_storage().data_ptr() in params for t in saved)
    # The backward casts each of those parameters itself, and says where the cast comes from.
    casts = graphs.nodes("backward", torch.ops.prims.convert_element_type.default)
    recast = [
        n for n in casts
        if n.args[0].op == "placeholder" and n.args[0].meta["val"].dtype == torch.float32 and META_KEY in n.meta
    ]  # fmt: skip
    assert len(recast) == len(rows)


def test_recomputed_casts_give_the_same_gradients_bit_for_bit(monkeypatch):
    _, recomputed, _, report, _ = _autocast_step(HotConfig(**ON))
    assert report.select(path="saved", decision=RECOMPUTED)
    monkeypatch.setattr(saved_activations, "cast_chain", lambda node, weight_like: ())
    _, kept, _, report, _ = _autocast_step(HotConfig(**ON))
    assert not report.select(path="saved", decision=RECOMPUTED)
    assert any("not by casts and views alone" in r.reason for r in report.select(path="saved", decision="kept"))
    assert all(torch.equal(a, b) for a, b in zip(recomputed, kept, strict=True))


def _traced(build) -> tuple[fx.Node, WeightLike]:
    """The first output of ``build(weight, x)`` traced, with its weight a parameter (input 0) and x not."""
    gm = make_fx(build)(torch.randn(8, 4), torch.randn(3, 4))
    gm.graph.find_nodes(op="placeholder")[0].meta["desc"] = types.SimpleNamespace(idx=0)
    value = gm.graph.output_node().args[0][0]
    return value, WeightLike(gm.graph, frozenset({0}))


@pytest.mark.parametrize(
    "build,chain",
    [
        (lambda w, x: (w.to(torch.bfloat16).t(),), ["_to_copy", "t"]),
        (lambda w, x: (w.to(torch.bfloat16).view(4, 8).contiguous().clone(),), ["_to_copy", "view", "clone"]),
        (lambda w, x: ((w * 2).to(torch.bfloat16),), None),  # not a cast: kept, the product stays exact
        (lambda w, x: (x.to(torch.bfloat16),), None),  # an activation, not a parameter
        (lambda w, x: (w,), None),  # the parameter itself: nothing to redo
        (lambda w, x: (w.to(torch.bfloat16), w.copy_(w * 0.5)), None),  # the graph writes the parameter
    ],
)
def test_only_casts_and_views_of_one_parameter_are_redone(build, chain):
    value, weight_like = _traced(build)
    found = cast_chain(value, weight_like)
    if chain is None:
        assert found == ()
    else:
        assert found[0].op == "placeholder" and [n.target.overloadpacket.__name__ for n in found[1:]] == chain


def test_recomputing_costs_a_read_of_the_parameter_and_a_write_of_the_cast():
    profile = BUILTIN_PROFILES["cpu-zen4-2core"]
    numel = 1536 * 384
    cost = recompute_cost(numel, 4, 2, profile)
    expected = numel * 4 / profile.read_bw + profile.write_seconds(numel * 2) + profile.kernel_overhead
    assert cost.original_s == 0 and cost.hot_s == pytest.approx(expected)
    assert (cost.saved_bytes_before, cost.saved_bytes_after) == (numel * 2, 0)
