"""The ``node.meta`` every node created by a HOT rewrite carries."""

from __future__ import annotations

import torch.fx as fx

META_KEY = "hot_compile"
# Meta an inserted node inherits from the node it stands in for, so that stack traces, module
# stacks and autograd sequence numbers stay linked to the user's code.
_INHERITED = ("seq_nr", "stack_trace", "nn_module_stack", "fwd_nn_module_stack", "fwd_source_fn_stack")


def provenance(rewrite: str, module: str, path: str, origin: fx.Node, region: str) -> dict:
    """Meta for nodes of ``rewrite`` standing in for ``origin``; ``region`` is "forward"/"backward"."""
    meta = {k: origin.meta[k] for k in _INHERITED if k in origin.meta}
    meta[META_KEY] = {"rewrite": rewrite, "module": module, "path": path, "replaces": origin.name}
    meta["partitioner_tag"] = "is_backward" if region == "backward" else "is_forward"
    return meta
