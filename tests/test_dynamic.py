"""Dynamic shapes: the pass decides on size hints, pads unknown divisibility, and adds no guard."""

import pytest
import sympy
import torch

import hot_compile
from hot_compile import HotConfig
from tests import tolerances as tol
from tests.data import make
from tests.harness import aot_compile, assert_rewritten
from tests.models import MLP, Block, grad_errors

# (batch, tokens): tokens never a multiple of 16
SHAPES = [(3, 17), (8, 33), (13, 50), (32, 70)]


def _is_size_one_exclusion(expr) -> bool:
    # Fake-tensor view metadata asks whether a split dimension has size 1 (a stride special case);
    # the resulting guard only excludes that size, like Dynamo's own 0/1 specialization.
    return isinstance(expr, sympy.Ne) and expr.args[1] == 1


@pytest.mark.parametrize("model_cls", [MLP, Block])
def test_pass_adds_no_shape_guard_under_dynamic_shapes(model_cls):
    model = model_cls()
    compiled, graphs = aot_compile(model, HotConfig(strict=True, policy="hot", rank=16), dynamic=True)
    for batch, tokens in SHAPES:
        errors = grad_errors(model, compiled, torch.randn(batch, tokens, 32))
        assert max(errors.values()) < tol.E2E_GRAD, (batch, tokens, errors)
    symbolic = [n for n in graphs.joint.graph.find_nodes(op="placeholder") if isinstance(n.meta.get("val"), torch.SymInt)]
    assert symbolic, "expected a dynamic graph"
    print("guards added by the pass:", graphs.new_guards)
    assert all(_is_size_one_exclusion(g) for g in graphs.new_guards)
    assert hot_compile.last_report().select(decision="HQ")


def test_inductor_dynamic_runs_all_shapes_with_at_most_one_recompile():
    compiles = []
    hot = hot_compile.backend(HotConfig(strict=True, policy="hot"))

    def counting_backend(gm, example_inputs, **kwargs):
        compiles.append(gm)
        return hot(gm, example_inputs, **kwargs)

    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend=counting_backend, dynamic=True)
    for batch, tokens in SHAPES:
        x = make("smooth", batch * tokens, 32, batch).reshape(batch, tokens, 32)
        errors = grad_errors(model, compiled, x)
        assert max(errors.values()) < tol.E2E_GRAD, (batch, tokens, errors)
        assert_rewritten()
    assert len(compiles) <= 2
