"""How Inductor lowers HOT's ops: an extern call, as for any custom op, whose view inputs are
realized first, so that every reader of a value shares one buffer.

Inductor's default for a custom op copies a view of a not-yet-computed pointwise value into a buffer
of the op's own (``ExternKernel.require_strides`` falls back to ``copy_input``). Two HOT ops reading
one value, as ABC's ``compress_activation`` and the forward's ``int8_linear`` both read a linear
layer's input, then got one copy each: on a transformer block, GELU's output was computed and written
twice, ``[tokens, 4·dim]`` more bytes held and written per layer. Realizing the viewed value in place
makes each reader's input a view of the same buffer.
"""

from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree

# The ops that read their tensors' values. ``draw_seed`` reads only its argument's device; realizing
# that argument could materialize a value nothing else needs.
_READING_OPS = (
    "hq_grad_input",
    "compress_activation",
    "hla_grad_weight",
    "int8_linear",
    "encode_rows",
    "encode_derivative",
    "conv_hq_grad_input",
    "conv_hla_grad_weight",
    "attention_backward",
)


def _realizing_fallback(op: torch._ops.OpOverload):
    from torch._inductor import ir, lowering

    extern_call = lowering.fallback_handler(op, add_to_fallback_set=False)

    def lower(*args, **kwargs):
        for arg in pytree.tree_leaves((args, kwargs)):
            if isinstance(arg, ir.TensorBox) and isinstance(arg.data, ir.BaseView):
                arg.realize()
        return extern_call(*args, **kwargs)

    return lower


@functools.cache
def register() -> None:
    """Install the lowerings (once a process) before Inductor compiles a graph holding HOT's ops."""
    from torch._inductor import lowering

    from . import attention_ops, conv_ops, ops  # noqa: F401  (the ops exist once their modules ran)

    for name in _READING_OPS:
        packet = getattr(torch.ops.hot_compile, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            lowering.register_lowering(op, type_promotion_kind=None)(_realizing_fallback(op))
