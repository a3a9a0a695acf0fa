"""Saved activations → int8 rows, or 4-bit codes of a derivative: what the partitioner keeps for the
backward, compressed.

HOT's ABC compresses each rewritten linear's input. The rest of what the forward keeps for the
backward (LayerNorm and residual inputs, GELU inputs, attention's query, key, value and output) stays
in the float dtype. This rewrite works on the partitioner's output, so its candidates are exactly the
tensors the forward hands the backward. Each float intermediate becomes one of two codes:

* **a 4-bit derivative** (after Few-Bit Backward, Novikov et al., ICML 2023): where the backward reads
  ``x`` only through one pointwise function ``f(x)`` that multiplies a gradient
  (:mod:`.pointwise_factor`), the forward saves ``f(x)`` in 4 bits, two codes a byte, over each row's
  range with stochastic rounding
  (:func:`~hot_compile.runtime.quant.quantize_range_stochastic`). For GELU's derivative (exact or
  with tanh) the encoder computes ``f(x)`` from ``x`` in float32, a row at a time, within 3·10⁻⁷ of
  the exact one: unbiased for that value, every error below one step ``(max f − min f) / 14`` of its
  row plus those 3·10⁻⁷. For another ``f`` the forward computes ``f(x)`` (at most as wide as bf16:
  :func:`derivative_dtype`) for the encoder, whose rounding adds 2⁻⁹ of ``|f|``;
* **int8 rows** otherwise: one float32 scale per row of at least :data:`MIN_ROW` values, round to
  nearest (``s = max|row| / 127``), dequantized where the backward first reads it; every error is at
  most half a level, ``max|row| / 254``.

A weight's cast (or view) is not saved at all: the backward recomputes it from the parameter
(:mod:`.saved_casts`). Graph inputs and parameters are left alone (they outlive the step anyway). The
rest is kept where :func:`why_kept` gives a reason, which the value's report row shows.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true
from torch.utils.checkpoint import CheckpointPolicy

from ..runtime import ops
from ..runtime.aten_impl import GIVEN
from ..runtime.quant import dequantize, unpack_nibbles
from .attention_precision import ATTENTION_BACKWARDS, ATTENTION_FORWARDS, arguments
from .cost_model import SiteCost
from .inline import insert_traced
from .legality import unsupported
from .pointwise_factor import PointwiseFactor, pointwise_factor
from .provenance import provenance
from .report import SiteRow
from .saved_casts import cast_chain, insert_recompute
from .sites import WeightLike, module_path, storage_source

aten = torch.ops.aten
REWRITE = "compress_saved"
ROW_BITS = 8
DERIVATIVE_BITS = 4
# Shortest row worth a float32 scale of its own: 4 bytes per 16 int8 values.
MIN_ROW = 16
INT8_ROWS = "int8"
DERIVATIVE = "f' 4-bit"
RECOMPUTED = "recomputed"


@dataclasses.dataclass
class SavedValue:
    """One tensor the forward hands the backward: its node in each graph and what becomes of it."""

    forward: fx.Node
    backward: fx.Node  # the backward graph's placeholder of the same name
    reason: str | None  # why it is kept; None: compressed
    factor: PointwiseFactor | None = None  # set: saved as the 4-bit code of f(x)
    recompute: tuple[fx.Node, ...] = ()  # set: not saved, the backward redoes this chain (saved_casts.cast_chain)

    @property
    def decision(self) -> str:
        if self.reason is not None:
            return "kept"
        if self.recompute:
            return RECOMPUTED
        return DERIVATIVE if self.factor is not None else INT8_ROWS


def _is_log_sum_exp(node: fx.Node) -> bool:
    return node.target is operator.getitem and node.args[0].target in ATTENTION_FORWARDS and node.args[1] == 1


def attention_masks(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose values ``graph``'s attention backwards read as their mask or bias, directly or
    through casts and views (the float32 backward of :mod:`.attention_precision` reads an upcast mask)."""
    backwards = (arguments(n) for t in ATTENTION_BACKWARDS for n in graph.find_nodes(op="call_function", target=t))
    masks = (a.get("attn_mask", a.get("attn_bias")) for a in backwards)
    return {storage_source(mask) for mask in masks if isinstance(mask, fx.Node)}


def memory_order(val: torch.Tensor) -> list[int] | None:
    """The permutation of ``val``'s dimensions that is contiguous, where ``val`` is dense with unit
    stride along its last dimension (its rows lie whole in memory); None otherwise. Codes are made in
    this order, so that the backward gets back the strides it was traced with."""
    shape, stride = [optimization_hint(d) for d in val.shape], [optimization_hint(d) for d in val.stride()]
    order = sorted(range(len(shape)), key=lambda d: (-stride[d], d))
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return order if order[-1] == len(shape) - 1 else None


def _reads_any_layout(node: fx.Node) -> bool:
    return node.target in ATTENTION_BACKWARDS or torch.Tag.pointwise in getattr(node.target, "tags", ())


def why_kept(
    node: fx.Node,
    placeholder: fx.Node,
    inner_outputs: set[fx.Node],
    weight_like: WeightLike,
    masks: set[fx.Node],
    redoable: bool = False,
) -> str | None:
    """Why the saved ``node`` stays as it is; None where it is compressed or recomputed. Cheap checks
    first. ``masks``: the backward's :func:`attention_masks`; ``redoable``: ``node`` has a
    :func:`~.saved_casts.cast_chain`."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return f"not a float tensor ({getattr(val, 'dtype', type(val).__name__)})"
    if (problem := unsupported([val])) is not None:
        return problem
    if node.meta.get("recompute") is CheckpointPolicy.MUST_SAVE:
        return "marked MUST_SAVE: HOT's compressed buffers, or a checkpoint policy's choice"
    if node in inner_outputs:
        return "also an output of the forward: the caller holds it anyway"
    if weight_like(node):
        return None if redoable else "computed from parameters alone, not by casts and views alone: the exact products that read it stay exact"
    if val.dim() == 0 or not isinstance(val.shape[-1], int) or val.shape[-1] < MIN_ROW:
        return f"rows shorter than {MIN_ROW} values: a scale per row would not shrink it"
    if any(statically_known_true(s == 0) for s in val.stride()):
        return "a broadcast view (a stride of 0)"
    if _is_log_sum_exp(node):
        return "an attention's log-sum-exp: half a level of error would scale a row of probabilities"
    if placeholder in masks:
        return "an attention mask: an additive mask may hold -inf"
    if memory_order(val) is None:
        fixed = [u for u in placeholder.users if not _reads_any_layout(u)]
        if fixed:
            return f"a strided view read by {fixed[0].target}, which needs its layout as it is"
    return None


def find_saved_values(
    fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, parameters: frozenset[int] | None
) -> list[SavedValue]:
    """The tensors the partitioned forward saves for the backward, each matched to its placeholder;
    ``parameters`` are the indices of the compiled function's inputs that are parameters."""
    weight_like = WeightLike(fw.graph, parameters)
    outputs = fw.graph.output_node().args[0]
    inner = {n for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    placeholders = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    position = {n: i for i, n in enumerate(bw.graph.nodes)}
    masks = attention_masks(bw.graph)
    saved = []
    for node in outputs[num_fwd_outputs:]:
        if not isinstance(node, fx.Node) or node.op == "placeholder" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue  # inputs and parameters outlive the step anyway; symbolic sizes travel separately
        placeholder = placeholders[node.name]
        chain = cast_chain(node, weight_like)
        reason = why_kept(node, placeholder, inner, weight_like, masks, redoable=bool(chain))
        recompute = chain if reason is None else ()
        factor = pointwise_factor(placeholder, position) if reason is None and not recompute else None
        saved.append(SavedValue(node, placeholder, reason, factor, recompute))
    return saved


def why_not_selected(config, module: str) -> str | None:
    """Why ``config`` (``module``'s own) leaves the module's saved values as they are (policy, option, globs)."""
    if config.policy == "off":
        return "policy='off'"
    if config.policy == "speed":
        return "policy='speed': compressing adds passes and saves no time"
    if not config.compress_saved:
        return "compress_saved=False"
    if not config.selects(module):
        return "excluded by include/exclude globs"
    return None


def _unique_name(name: str, taken: set[str]) -> str:
    """``name``, suffixed until it is not in ``taken`` (the names of both graphs), which it joins."""
    candidate, i = name, 0
    while candidate in taken:
        i += 1
        candidate = f"{name}_{i}"
    taken.add(candidate)
    return candidate


def _renamed(graph: fx.Graph, node: fx.Node, name: str) -> fx.Node:
    """A copy of ``node`` named ``name`` in its place (forward outputs and backward inputs pair by name)."""
    with graph.inserting_after(node):
        copy = graph.create_node(node.op, node.target, node.args, node.kwargs, name=name)
    copy.meta = dict(node.meta)
    node.replace_all_uses_with(copy)
    graph.erase_node(node)
    return copy


# One extern op encodes each saved value: HOT's CPU library, or elsewhere a kernel shared by every
# site and shape (ops._run), where Inductor fusing a row reduction into each producer made its own
# kernel, and the compile, per site.
def _encoder_rows(order: list[int]):
    return lambda x: ops.encode_rows(x.permute(order), ROW_BITS)


def derivative_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the forward writes a derivative ``f(x)`` in for its code, where the encoder does not
    compute ``f`` itself (:data:`~hot_compile.runtime.aten_impl.GIVEN`), ``x`` being of ``dtype``:
    bf16 for float32 (and under autocast, where a derivative is computed in float32 from a bf16
    input), else ``dtype``. Its rounding, at most 2⁻⁹ of ``|f|``, is a few percent of a 4-bit step
    (``(max f − min f) / 14``), and it halves the buffer the forward writes and the encoder reads: on
    a CPU a float32 one above glibc's mmap threshold faults on every page."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def _derivative_encoder(dtype: torch.dtype, function: str):
    """The code of a derivative: ``function`` of the saved ``x`` (of ``dtype``), computed by the
    encoder; or, for :data:`~hot_compile.runtime.aten_impl.GIVEN`, the value ``f(x)`` the forward wrote."""
    code_dtype = derivative_dtype(dtype)

    def encode(value: torch.Tensor):
        if function == GIVEN and code_dtype.itemsize < value.dtype.itemsize:
            value = value.to(code_dtype)
        return ops.encode_derivative(value, ops.draw_seed(value), DERIVATIVE_BITS, function)

    return encode


def _order(val: torch.Tensor) -> list[int]:
    """:func:`memory_order`, or the dimensions as they are for a view whose readers take any layout
    (the backward's readers then get the layout they were traced with: a head of a fused qkv output as
    [batch, heads, tokens, d], whose rows the CPU encoder reads in place)."""
    return memory_order(val) or list(range(val.dim()))


def _encode(graph: fx.Graph, s: SavedValue, created: list[fx.Node]) -> list[fx.Node]:
    """Insert ``s``'s code into the forward after ``s.forward``; returns the nodes to save."""
    meta = provenance(REWRITE, module_path(s.forward), "saved", s.forward, "forward")
    if s.factor is None:
        encode = _encoder_rows(_order(s.forward.meta["val"]))
        return list(insert_traced(graph, encode, [s.forward], before=s.forward.next, meta=meta, created=created))
    factor = s.factor
    # The encoder computes a known derivative from x itself; for another f the forward computes f(x).
    known = factor.function != GIVEN
    env = {s.backward: s.forward}
    with graph.inserting_before(s.forward.next):
        for node in factor.reads_through if known else factor.nodes:  # moved from the backward into the forward
            env[node] = graph.node_copy(node, env.__getitem__)
            env[node].meta.update(meta)
            created.append(env[node])
    if not known:
        value = env[factor.value]
    else:
        value = env[factor.reads_through[-1]] if factor.reads_through else s.forward
    encode = _derivative_encoder(s.forward.meta["val"].dtype, factor.function)
    return list(insert_traced(graph, encode, [value], before=value.next, meta=meta, created=created))


def _decode(graph: fx.Graph, s: SavedValue, inputs: list[fx.Node], position: dict[fx.Node, int]) -> None:
    """Insert ``s``'s decoding before its first reader in the backward, in place of what it stood for."""
    meta = provenance(REWRITE, module_path(s.forward), "saved", s.forward, "backward")
    stands_for = s.backward if s.factor is None else s.factor.value
    dtype = stands_for.meta["val"].dtype
    first_reader = min(stands_for.users, key=position.__getitem__)  # original nodes: readers of saved values
    if s.factor is None:
        order = _order(stands_for.meta["val"])
        inverse = sorted(range(len(order)), key=order.__getitem__)

        def decode(q, scale):
            return dequantize(q, scale).to(dtype).permute(inverse)

    else:

        def decode(packed, lo, step):
            return (lo + unpack_nibbles(packed).float() * step).to(dtype)

    restored = insert_traced(graph, decode, inputs, before=first_reader, meta=meta, created=[])
    stands_for.replace_all_uses_with(restored)
    if s.factor is not None:
        for node in reversed(s.factor.nodes):
            graph.erase_node(node)
    graph.erase_node(s.backward)


def _recompute_in_backward(bw_graph: fx.Graph, s: SavedValue, position: dict, sources: dict[str, fx.Node]) -> list[fx.Node]:
    """Let the backward redo ``s``'s chain from its parameter before its first reader; returns what the
    forward saves in its place: the parameter, unless the backward has it already (``sources``, its
    placeholders by the name of what they stand for, gains it)."""
    parameter = s.recompute[0]
    first_reader = min(s.backward.users, key=position.__getitem__)
    added = parameter.name not in sources
    if added:
        with bw_graph.inserting_before(s.backward):
            sources[parameter.name] = bw_graph.placeholder(parameter.name)
        sources[parameter.name].meta = {"val": parameter.meta["val"]}
    meta = provenance(REWRITE, module_path(s.forward), "saved", s.forward, "backward")
    insert_recompute(bw_graph, s.recompute, sources[parameter.name], s.backward, first_reader, meta)
    return [parameter] if added else []


def compress_saved_values(fw: fx.GraphModule, bw: fx.GraphModule, saved: list[SavedValue]) -> None:
    """Save each compressed value of ``saved`` as its code; the backward decodes it before its first
    reader, or recomputes a weight's cast from the parameter. The forward's new nodes are built first,
    so a failure while building them leaves both graphs as they were."""
    fw_graph, bw_graph = fw.graph, bw.graph
    chosen = [s for s in saved if s.reason is None and not s.recompute]
    recomputed = [s for s in saved if s.reason is None and s.recompute]
    for device in {s.forward.meta["val"].device for s in chosen}:
        ops.prepare(device)
    created: list[fx.Node] = []
    try:
        codes = [_encode(fw_graph, s, created) for s in chosen]
    except BaseException:
        for node in reversed(created):
            fw_graph.erase_node(node)
        raise

    replacement: dict[fx.Node, list[fx.Node]] = {}
    taken = {n.name for g in (fw_graph, bw_graph) for n in g.nodes}
    position = {n: i for i, n in enumerate(bw_graph.nodes)}
    for s, nodes in zip(chosen, codes):
        suffixes = ("int8", "scale") if s.factor is None else ("df4", "df_lo", "df_step")
        nodes = [_renamed(fw_graph, n, _unique_name(f"{s.forward.name}_{suffix}", taken)) for n, suffix in zip(nodes, suffixes)]
        replacement[s.forward] = nodes
        with bw_graph.inserting_before(s.backward):
            inputs = [bw_graph.placeholder(node.name) for node in nodes]
        for placeholder, node in zip(inputs, nodes):
            placeholder.meta = {"val": node.meta["val"]}
        _decode(bw_graph, s, inputs, position)
    sources = {n.name: n for n in bw_graph.find_nodes(op="placeholder")}
    for s in recomputed:
        replacement[s.forward] = _recompute_in_backward(bw_graph, s, position, sources)

    output = fw_graph.output_node()
    output.args = (tuple(code for node in output.args[0] for code in replacement.get(node, [node])),)
    fw.recompile()
    bw.recompile()


def saved_row(s: SavedValue, cost: SiteCost | None) -> SiteRow:
    """The report row of one saved value: bytes before and after, and ``cost``, its compression's
    estimate (:func:`~.saved_budget.compression_cost`; None where it was not estimated), shown for a
    value kept over the budget as a kept product's HOT estimate is."""
    val = s.forward.meta["val"]
    before = optimization_hint(val.numel()) * val.element_size()
    decision = s.decision
    if decision == INT8_ROWS:
        reason, numerics = "error ≤ max|row|/254", "INT8 per row, round to nearest"
    elif decision == RECOMPUTED:
        reason = "computed from a parameter by casts and views: the backward redoes them from the parameter, which outlives the step"
        numerics = "exact (the same ops in the backward)"
    elif decision == DERIVATIVE:
        reason = f"the backward reads it only through f(x) = {s.factor.describe()}, times a gradient: f(x) is saved"
        if s.factor.function == GIVEN:
            code_dtype = str(derivative_dtype(val.dtype)).removeprefix("torch.")
            numerics = f"4-bit f(x) per row (min, step), stochastic rounding of f(x) in {code_dtype}"
        else:
            numerics = "4-bit f(x) per row (min, step), stochastic rounding of f(x) computed from x in float32 by the encoder"
    else:
        reason, numerics = s.reason, "-"
    return SiteRow(
        module=module_path(s.forward),
        path="saved",
        shape="×".join(str(optimization_hint(d)) for d in val.shape),
        dtype=str(val.dtype).removeprefix("torch."),
        decision=decision,
        reason=reason,
        saved_bytes_before=before,
        saved_bytes_after=before if cost is None or s.reason else cost.saved_bytes_after,
        est_original_ms=None if cost is None else cost.original_s * 1e3,
        est_hot_ms=None if cost is None else cost.hot_s * 1e3,
        numerics=numerics,
    )
