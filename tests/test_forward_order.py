"""The forward's encoders moved down to the next product (:mod:`hot_compile.passes.forward_order`)."""

import operator
import warnings

import torch
import torch.fx as fx
import torch.nn as nn
from torch._inductor.utils import run_and_get_code

import hot_compile
from hot_compile import HotConfig
from hot_compile.passes.forward_order import sink_encoders
from tests.harness import aot_compile

aten, prims, hot_ops = torch.ops.aten, torch.ops.prims, torch.ops.hot_compile


def _mlp_block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def _order(graph: fx.Graph) -> list[str]:
    """The ops of ``graph`` in order, by name (their ``getitem`` nodes left out)."""
    return [n.target._opname for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def _graph(reader_between: bool, product_reads: bool) -> fx.Graph:
    """``x = relu(a)``, its encoder, a weight's cast, then a product of ``x`` (or of ``a``), with a
    pointwise reader of ``x`` in between if asked."""
    g = fx.Graph()
    a, w = g.placeholder("a"), g.placeholder("w")
    x = g.call_function(aten.relu.default, (a,))
    code = g.call_function(hot_ops.encode_rows.default, (x, 8))
    q, scale = (g.call_function(operator.getitem, (code, i)) for i in range(2))
    outputs = [q, scale]
    if reader_between:
        outputs.append(g.call_function(aten.neg.default, (x,)))
    cast = g.call_function(prims.convert_element_type.default, (w, torch.bfloat16))
    product = g.call_function(aten.mm.default, (x if product_reads else a, cast))
    g.output((product, *outputs))
    return g


def test_an_encoder_moves_past_the_product_that_reads_its_input():
    g = _graph(reader_between=False, product_reads=True)
    assert sink_encoders(g) == 3
    g.lint()
    assert _order(g) == ["relu", "convert_element_type", "mm", "encode_rows"]


def test_an_encoder_passes_a_reader_that_is_not_the_last():
    g = _graph(reader_between=True, product_reads=True)
    assert sink_encoders(g) == 3
    g.lint()
    assert _order(g) == ["relu", "neg", "convert_element_type", "mm", "encode_rows"]


def test_the_encoder_of_a_value_nothing_else_reads_stays_after_it():
    g = _graph(reader_between=False, product_reads=False)
    assert sink_encoders(g) == 0
    assert _order(g) == ["relu", "encode_rows", "convert_element_type", "mm"]


def test_an_encoder_never_passes_the_last_reader_of_its_input():
    g = _graph(reader_between=True, product_reads=False)
    assert sink_encoders(g) == 0
    assert _order(g) == ["relu", "encode_rows", "neg", "convert_element_type", "mm"]


def test_the_partitioned_forward_has_each_compression_after_its_product():
    """Under autocast, each linear's ABC compression follows the integer product that reads the same
    input, after the weight's cast; GELU's derivative code stays before GELU, which reads its input."""
    compiled, graphs = aot_compile(_mlp_block(), HotConfig(strict=True, policy="hot"))
    with torch.autocast("cpu", torch.bfloat16):
        out = compiled(torch.randn(4, 32, 64))
    out.float().sum().backward()
    order = _order(graphs.forward.graph)
    products = [i for i, name in enumerate(order) if name.startswith("int8_linear")]
    compressions = [i for i, name in enumerate(order) if name.startswith("compress_activation")]
    assert len(products) == len(compressions) == 2
    assert all(p + 1 == c for p, c in zip(products, compressions))
    gelu = next(i for i, name in enumerate(order) if name.startswith("erf"))
    assert products[0] < order.index("encode_derivative") < gelu < products[1]


def test_a_failing_move_warns_once_and_leaves_the_forward_as_it_was(monkeypatch):
    def fail(graph):
        raise RuntimeError("no order")

    monkeypatch.setattr(hot_compile.inductor_pass, "sink_encoders", fail)
    compiled, graphs = aot_compile(_mlp_block(), HotConfig(policy="hot"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", torch.bfloat16):
            out = compiled(torch.randn(4, 32, 64))
        out.float().sum().backward()
    messages = [str(w.message) for w in caught if issubclass(w.category, hot_compile.HotPassWarning)]
    assert len(messages) == 1 and "its encoders stay where they were (RuntimeError: no order)" in messages[0]
    order = _order(graphs.forward.graph)
    assert order.index("compress_activation") < order.index("int8_linear")


def _forward_kernels(backend: str, **options) -> tuple[int, str]:
    torch._dynamo.reset()
    compiled = torch.compile(_mlp_block(), backend=backend, options=options or None)

    def step():
        with torch.autocast("cpu", torch.bfloat16):
            out = compiled(torch.randn(4, 32, 64))
        out.float().sum().backward()

    _, (forward_code, *_) = run_and_get_code(step)
    return forward_code.count("async_compile.cpp_pybinding("), forward_code


def test_the_mlp_block_compiles_as_many_forward_kernels_as_under_inductor():
    """Inductor compiles each kernel of generated code on its own; an encoder between a GELU and the
    next weight's cast would split them into two."""
    inductor, _ = _forward_kernels("inductor")
    hot, code = _forward_kernels("hot", policy="hot")
    assert "torch.ops.hot_compile.int8_linear" in code and "torch.ops.hot_compile.compress_activation" in code
    assert hot == inductor
