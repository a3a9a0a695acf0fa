"""The HOT pass as Inductor runs it: a ``CustomGraphPass`` for ``joint_custom_post_pass``.

:func:`hot_compile.passes.run_hot_pass` rewrites the graph. This wrapper adds what a user sees around
it: the report of the last compiled graph, the dumps and logs asked for, and the cache key. A failure
inside the pass leaves the graph exactly as it was (every inserted node is removed before anything is
rewired) and warns once; ``HotConfig(strict=True)`` raises instead.
"""

from __future__ import annotations

import pathlib
import warnings

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn, get_hash_for_files

from . import config as config_module, passes, plan as plan_module, runtime
from .config import HotConfig
from .observability import inspection
from .observability.report import publish
from .passes import run_hot_pass, run_saved_pass
from .passes.forward_order import sink_encoders
from .runtime.devices import load_calibrated, resolve_profile

__all__ = ["GRAPH_SHAPING_SOURCES", "HotJointPass", "HotPartitioner", "HotPassWarning", "joint_pass"]


class HotPassWarning(UserWarning):
    """The HOT pass could not rewrite a graph; it was compiled unchanged."""


def _files(module, *patterns: str) -> tuple[pathlib.Path, ...]:
    path = pathlib.Path(module.__file__)
    if path.name != "__init__.py":
        return (path,)
    return tuple(p for pattern in patterns for p in sorted(path.parent.glob(pattern)))


# What decides a rewritten graph, and so the cache key: the pass, the ops it inserts (their Python and
# C++ sources) and the config. The API around them, the observability and the harness are not in it,
# so editing a benchmark never invalidates a user's compiled graphs.
GRAPH_SHAPING_SOURCES: tuple[pathlib.Path, ...] = (
    *_files(passes, "*.py"),
    *_files(runtime, "*.py", "*.cpp"),
    *_files(config_module),
    *_files(plan_module),
)


def _fail_softly(config: HotConfig, what: str, exc: Exception) -> None:
    """Raise ``exc`` under ``strict``; else count the failure and warn once, naming ``what`` happened."""
    if config.strict:
        raise exc
    counters["hot"]["graphs_failed"] += 1
    warnings.warn(f"hot_compile: {what} ({type(exc).__name__}: {exc})", HotPassWarning, stacklevel=3)


class HotJointPass(CustomGraphPass):
    """Inductor joint-graph pass applying HOT under a fixed :class:`HotConfig`."""

    def __init__(self, config: HotConfig | None = None, parameters: frozenset[int] | None = None):
        self.config = config or HotConfig()
        # Which inputs of the compiled function are parameters (the backend knows; see run_hot_pass).
        self.parameters = parameters
        # The report of the graph this pass last rewrote, for the partitioner's rows; None after a failure.
        self.report = None

    def __call__(self, graph: fx.Graph) -> None:
        self.report = None
        compile_id = torch._guards.CompileContext.current_compile_id()
        inspected = inspection.JointGraphInspection(graph, self.config, compile_id)
        name = inspected.name
        try:
            report = run_hot_pass(graph, self.config, name, self.parameters)
        except Exception as exc:
            inspected.finish(graph, error=exc)
            _fail_softly(self.config, f"the HOT pass failed on graph {name} and left it unchanged", exc)
            return
        publish(report)
        self.report = report
        inspected.finish(graph, report)

    def uuid(self) -> bytes | None:
        # A cache hit skips the pass, and with it the dump or log someone asked for: no uuid makes
        # Inductor bypass the FX-graph and AOTAutograd caches while the pass is being inspected.
        if inspection.inspection_requested(self.config):
            return None
        # The FX-graph and AOTAutograd caches key on this: it must change with the pass's code and
        # every setting, or a cache hit would skip the pass (or replay another config's rewrite);
        # decisions also depend on the device profile: this machine's calibration, if any, or the
        # built-in profile its CPU's features select.
        calibrated = load_calibrated()
        parameters = None if self.parameters is None else sorted(self.parameters)
        extra = (
            f"{self.config!r}|{torch.__version__}|{calibrated.to_json() if calibrated else ''}"
            f"|{resolve_profile(torch.device('cpu')).name}|{parameters}"
        )
        return get_hash_for_files(tuple(str(p) for p in GRAPH_SHAPING_SOURCES), extra=extra)


class HotPartitioner(CustomPartitionerFn):
    """Inductor's partitioner (or the one a user set as ``custom_partitioner_fn``), then the
    compression of what its forward saves for the backward (:func:`hot_compile.passes.run_saved_pass`),
    then the forward's encoders moved next to the products that read their inputs
    (:func:`hot_compile.passes.forward_order.sink_encoders`).

    Its rows join the report of the graph ``joint_pass`` rewrote. Where that pass failed, or this one
    does, the partition is returned as the partitioner made it (and a failure warns once).
    """

    def __init__(self, joint_pass: HotJointPass, inner: CustomPartitionerFn | None = None):
        self.joint_pass = joint_pass
        self.inner = inner

    def _partition(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        if self.inner is not None:
            return self.inner(gm, joint_inputs, **kwargs)
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs):
        fw, bw = self._partition(gm, joint_inputs, **kwargs)
        report, config = self.joint_pass.report, self.joint_pass.config
        if report is None:
            return fw, bw
        if config.any_module("compress_saved"):
            try:
                rows = run_saved_pass(fw, bw, kwargs["num_fwd_outputs"], config, self.joint_pass.parameters, report.products())
            except Exception as exc:
                what = f"compressing the saved activations of graph {report.graph} failed; they are saved as the partitioner chose"
                _fail_softly(config, what, exc)
                fw, bw = self._partition(gm, joint_inputs, **kwargs)
            else:
                report.rows.extend(rows)
        try:
            moved = sink_encoders(fw.graph)
        except Exception as exc:
            _fail_softly(config, f"ordering the forward of graph {report.graph} failed; its encoders stay where they were", exc)
        else:
            counters["hot"]["encoders_moved"] += moved
            if moved:
                fw.recompile()
        return fw, bw

    def uuid(self) -> bytes | None:
        joint = self.joint_pass.uuid()
        inner = "min_cut" if self.inner is None else self.inner.uuid()
        return None if joint is None or inner is None else f"{joint}|{inner}".encode()


def joint_pass(config: HotConfig | None = None) -> HotJointPass:
    """The HOT pass for ``torch._inductor.config.joint_custom_post_pass``. Installed this way it is not
    told which graph inputs are parameters: weights stored as ``[K, N]`` or computed in the graph are
    then no sites (their products are reported); ``backend="hot"`` covers them."""
    return HotJointPass(config)


def parameter_inputs(example_inputs: list) -> frozenset[int]:
    """The indices of a Dynamo graph's inputs that are parameters (Dynamo passes them as themselves)."""
    return frozenset(i for i, t in enumerate(example_inputs) if isinstance(t, torch.nn.Parameter))
