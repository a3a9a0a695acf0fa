"""Bytes a forward keeps for its backward, measured through ``saved_tensors_hooks``."""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def _storages(t: torch.Tensor) -> list[tuple[int, int]]:
    """(data pointer, bytes) of each storage behind ``t``, through traceable tensor subclasses."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(t, name))]
    storage = t.untyped_storage()
    return [(storage.data_ptr(), storage.nbytes())]


def saved_for_backward_bytes(run: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` executes.

    Each storage counts once however many saved tensors view it; storages of ``exclude`` (a model's
    parameters, which live on regardless) do not count. Works through compiled graphs (AOTAutograd
    saves its residuals through the same hooks) and tensor subclasses.
    """
    excluded = {ptr for t in exclude for ptr, _ in _storages(t)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        for ptr, nbytes in _storages(t):
            if ptr not in excluded:
                seen.setdefault(ptr, nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def peak_live_bytes(run: Callable[[], object]) -> int:
    """The most bytes of CPU tensors that ``run()`` allocates alive at one time.

    The CPU counterpart of ``torch.cuda.max_memory_allocated`` over ``run()``: the running sum of
    ``torch.profiler``'s allocation and free events, from zero at its start. Tensors that existed
    before ``run()`` count neither alive nor freed, and what the allocator holds beyond live tensors
    (freed memory kept by the process, fragmentation) is not in it: peak RSS measures that.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak
