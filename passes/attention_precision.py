"""The attention backward where the device's half-precision kernel is the slower one.

Under bf16 autocast, ``scaled_dot_product_attention`` on the CPU runs the flash-attention kernels in
bf16, and the backward (``_scaled_dot_product_flash_attention_for_cpu_backward``) is the slow one: it
takes 1.3–1.8× as long as the float32 kernel with the casts of its inputs and outputs around it on
Zen 4, and 1.3× (ViT-S's heads) to 3–4× (MiniLM's) on Sapphire Rapids, AMX's bf16 tiles
notwithstanding (BENCHMARKS.md). Where the device profile says so, the backward runs instead
- as products of its materialized scores (:mod:`hot_compile.runtime.attention_ops`), where
  that is faster still (:attr:`~hot_compile.runtime.devices.DeviceProfile.attention_backward_products`)
  and the attention has no mask, dropout or causal mask;
- else in float32 on upcast inputs, its gradients cast back
  (:attr:`~hot_compile.runtime.devices.DeviceProfile.fp32_attention_backward`): the same function,
  computed more exactly.
The forward is left as it is (its bf16 kernel is as fast as float32's).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.fx.operator_schemas import normalize_function

from ..runtime import attention_ops
from .inline import insert_traced
from .provenance import provenance
from .sites import module_path

aten = torch.ops.aten
FLASH_CPU_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
HALF = (torch.bfloat16, torch.float16)
REWRITE = "attention_backward_fp32"
PRODUCTS_REWRITE = "attention_backward_products"
# The fused kernels of scaled_dot_product_attention: query, key, value are a forward's first three
# arguments and a backward's second to fourth.
ATTENTION_FORWARDS = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)
ATTENTION_BACKWARDS = (
    torch.ops.hot_compile.attention_backward.default,  # this pass's, with the same first six arguments
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
)


@dataclasses.dataclass
class AttentionSite:
    node: fx.Node  # the backward of one attention
    module_path: str

    @property
    def shape(self) -> tuple:
        """(B, H, L, D) of the query."""
        return tuple(self.node.args[1].meta["val"].shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.node.args[0].meta["val"].dtype


def arguments(node: fx.Node) -> dict:
    """The arguments of an attention ``node`` (one of :data:`ATTENTION_FORWARDS` or
    :data:`ATTENTION_BACKWARDS`) by name, defaults included."""
    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs


def find_attention_backwards(graph: fx.Graph, backward: set[fx.Node]) -> list[AttentionSite]:
    """The CPU flash-attention backwards in half precision of ``graph``'s backward region."""
    return [
        AttentionSite(node, module_path(node))
        for node in graph.find_nodes(op="call_function", target=FLASH_CPU_BACKWARD)
        if node in backward and isinstance(node.args[0].meta.get("val"), torch.Tensor) and node.args[0].meta["val"].dtype in HALF
    ]


def upcast_attention_backward(graph: fx.Graph, site: AttentionSite, created: list[fx.Node]) -> list[fx.Node]:
    """Insert ``site``'s backward on float32 operands; returns the nodes standing in for its three
    gradients (query, key, value), each cast back to its original dtype."""
    node = site.node
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    mask = node.kwargs.get("attn_mask")
    constants, kwargs = node.args[len(tensors) :], {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
    out_dtypes = [v.dtype for v in node.meta["val"]]

    def fp32_backward(*operands):
        upcast = [t.float() if t.dtype in HALF else t for t in operands]  # a boolean mask stays boolean
        extra = {"attn_mask": upcast.pop()} if mask is not None else {}
        grads = FLASH_CPU_BACKWARD(*upcast, *constants, **kwargs, **extra)
        return [g.to(dtype) for g, dtype in zip(grads, out_dtypes)]

    meta = provenance(REWRITE, site.module_path, "attn", node, "backward")
    inputs = tensors + ([mask] if mask is not None else [])
    return insert_traced(graph, fp32_backward, inputs, before=node, meta=meta, created=created)


def replace_attention_backward(graph: fx.Graph, site: AttentionSite, stand_ins: list[fx.Node]) -> None:
    """Point the ``getitem`` users of ``site``'s backward at ``stand_ins`` and erase it."""
    for user in list(site.node.users):
        if user.target is not operator.getitem:
            raise RuntimeError(f"{site.node.name} has a user other than getitem: {user.format_node()}")
        user.replace_all_uses_with(stand_ins[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(site.node)


# B·H·L·S·E of an attention below which its fused kernel stays the faster. Zen 4, the products' time
# over the float32 kernel's (tools/attention_bench.py): as chunks of heads from Python (score products
# fused), one thread 1.61 at 1·10⁶, 1.10 at 4·10⁶, 0.82 at 1.7·10⁷, 0.70-0.78 from 1.2·10⁸; two
# threads 1.97, 0.80, 0.66, then 0.70-0.94. As one native kernel, two threads 1.14 at 1·10⁶, 0.51 at
# 4·10⁶, 0.47 at 1.7·10⁷, 0.42-0.46 from 2·10⁸. Set where a whole bf16 step of the ViT task (1·10⁶)
# ran 5% slower with the products, before they were fused; no whole step was measured between 4·10⁶
# and 2²⁶.
MIN_PRODUCTS_WORK = 1 << 26


def products_illegal(site: AttentionSite) -> str | None:
    """What of ``site``'s attention :func:`~hot_compile.runtime.attention_ops.attention_backward` does
    not compute, or None."""
    args = arguments(site.node)
    if args["dropout_p"]:
        return "dropout"
    if args["is_causal"]:
        return "a causal mask (the fused kernel skips the masked half)"
    if args.get("attn_mask") is not None:
        return "an attention mask"
    if not isinstance(site.shape[-1], int):
        return "a symbolic head size"
    return None


def products_too_small(site: AttentionSite) -> str | None:
    """Why the products would not gain on ``site``'s attention (its size, :data:`MIN_PRODUCTS_WORK`), or None."""
    b, h, l, e = (optimization_hint(d) for d in site.shape)
    work = b * h * l * e * optimization_hint(site.node.args[2].meta["val"].shape[-2])
    if work < MIN_PRODUCTS_WORK:
        return f"B·H·L·S·E = {work} under {MIN_PRODUCTS_WORK}, where the fused kernel is faster"
    return None


def why_not_products(site: AttentionSite) -> str | None:
    """Why ``site``'s backward does not run as products, or None: legality, then profitability."""
    return products_illegal(site) or products_too_small(site)


def products_attention_backward(graph: fx.Graph, site: AttentionSite, created: list[fx.Node]) -> list[fx.Node]:
    """Insert ``site``'s backward as products of its scores; returns the nodes standing in for its three
    gradients (query, key, value)."""
    args = arguments(site.node)
    scale = args["scale"] if args.get("scale") is not None else site.shape[-1] ** -0.5

    def backward(grad_out, query, key, value, out, logsumexp):
        return list(attention_ops.attention_backward(grad_out, query, key, value, out, logsumexp, float(scale)))

    meta = provenance(PRODUCTS_REWRITE, site.module_path, "attn", site.node, "backward")
    return insert_traced(graph, backward, list(site.node.args[:6]), before=site.node, meta=meta, created=created)
