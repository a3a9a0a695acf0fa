"""Compile a model with the HOT pass via AOTAutograd alone (no Inductor), keeping its graphs."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table

from hot_compile import HotConfig
from hot_compile.inductor_pass import HotJointPass, HotPartitioner, parameter_inputs


class Graphs:
    """The joint graph after the pass and the partitioned forward/backward of the last compile."""

    joint: torch.fx.GraphModule
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule

    def nodes(self, which: str, target=None):
        return [n for n in getattr(self, which).graph.nodes if target is None or n.target == target]

    def saved(self) -> list:
        """The values the forward saves for the backward (its outputs past the user outputs)."""
        inputs = [n for n in self.backward.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        return [n.meta["val"] for n in inputs if isinstance(n.meta.get("val"), torch.Tensor)]


def aot_compile(model, config: HotConfig | None = None, pass_cls=HotJointPass, **compile_kwargs):
    """``torch.compile`` with an aot_autograd backend running the HOT pass on the joint graph, then the
    min-cut partitioner and the compression of what it saves (:class:`HotPartitioner`, as the backend
    does), with Inductor's decompositions but no Inductor codegen.

    Guards the pass adds to the shape environment are recorded in ``graphs.new_guards``."""
    graphs = Graphs()
    hot_pass = graphs.hot_pass = pass_cls(config or HotConfig(strict=True, policy="hot"))

    def partition(joint, inputs, **kwargs):
        fake_mode = detect_fake_mode([n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")])
        shape_env = fake_mode.shape_env if fake_mode else None
        known = len(shape_env.guards) if shape_env else 0
        hot_pass(joint.graph)
        graphs.new_guards = [g.expr for g in shape_env.guards[known:]] if shape_env else []
        joint.graph.lint()
        joint.recompile()
        graphs.joint = joint
        graphs.forward, graphs.backward = HotPartitioner(hot_pass)(joint, inputs, **kwargs)
        return graphs.forward, graphs.backward

    def boxed(gm, _):
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition, decompositions=select_decomp_table()
    )

    def hot_aot(gm, example_inputs):
        hot_pass.parameters = parameter_inputs(example_inputs)  # as the hot backend tells its pass
        return backend(gm, example_inputs)

    return torch.compile(model, backend=hot_aot, **compile_kwargs), graphs


def pin_int8_path(monkeypatch, kind: str) -> None:
    """Make ``int8_matmul`` take the integer GEMM ``kind`` (:func:`hot_compile.runtime.int8_gemm.int8_gemm_kind`:
    ``"int_mm"``, ``"u8s8"`` or ``"float"``) whatever this CPU has, and HOT's CPU ops call it (not their
    own GEMM, :func:`hot_compile.runtime.cpu_gemm.fused_gemm`)."""
    from hot_compile.runtime import cpu_gemm, int8_gemm

    if kind == "u8s8" and not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN's uint8 × int8 linear needs a torch build with oneDNN")
    monkeypatch.setattr(int8_gemm, "int8_gemm_kind", lambda device: kind)
    monkeypatch.setattr(int8_gemm, "CPU_INT8_INSTRUCTIONS", kind == "int_mm")
    monkeypatch.setattr(cpu_gemm, "fused_gemm", lambda: "")


def assert_rewritten(report=None) -> None:
    """The report (the last compiled graph's by default) shows both backward rewrites: HQ on a
    grad_input and HLA+ABC on a grad_weight."""
    import hot_compile

    report = report or hot_compile.last_report()
    assert report is not None and report.select(path="gx", decision="HQ"), report
    assert report.select(path="gw", decision="HLA+ABC"), report
