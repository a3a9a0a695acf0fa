"""The ``hot`` torch.compile backend: Inductor with the HOT pass on the joint graph.

``torch.compile(model, backend="hot", mode=..., options=...)`` reaches :func:`hot` through the
``torch_dynamo_backends`` entry point. HOT keys of ``options`` build a :class:`HotConfig`; every other
key, and the expansion of ``mode``, goes to Inductor as ``config_patches`` (not a ``config.patch``
context: the backward is compiled lazily, outside any context around this call).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

from .observability import report
from .config import HotConfig, split_options
from .inductor_pass import HotJointPass, HotPartitioner, parameter_inputs
from .observability.inspection import NO_COMPILE_ID, record_partition
from .runtime import lowerings


def _chain_joint_passes(existing: Any, hot_pass: HotJointPass) -> list:
    """The user's joint_custom_post_pass(es), then HOT's (a user's own HOT pass is replaced)."""
    if existing is None:
        existing = []
    elif not isinstance(existing, (list, tuple)):
        existing = [existing]
    return [p for p in existing if not isinstance(p, HotJointPass)] + [hot_pass]


def compile_with_hot(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    config: HotConfig,
    mode: str | None = None,
    inductor_options: dict[str, Any] | None = None,
):
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    lowerings.register()
    patches: dict[str, Any] = dict(list_mode_options(mode)) if mode else {}
    patches.update(inductor_options or {})
    hot_pass = HotJointPass(config, parameter_inputs(example_inputs))
    patches["joint_custom_post_pass"] = _chain_joint_passes(
        patches.get("joint_custom_post_pass", torch._inductor.config.joint_custom_post_pass), hot_pass
    )
    existing = patches.get("custom_partitioner_fn", torch._inductor.config.custom_partitioner_fn)
    if isinstance(existing, HotPartitioner):  # a user's HOT partitioner is replaced, as the joint pass is
        existing = existing.inner
    patches["custom_partitioner_fn"] = HotPartitioner(hot_pass, existing)
    published = report.publications()
    compiled = compile_fx(gm, example_inputs, inner_compile=_showing_partitions(config), config_patches=patches)
    _keep_report(gm, example_inputs, hot_pass, ran=report.publications() != published)
    return compiled


def _keep_report(gm: torch.fx.GraphModule, example_inputs: list, hot_pass: HotJointPass, ran: bool) -> None:
    """Make ``last_report()`` describe this compile even when a cache hit skipped the pass: the pass's
    report is kept under a key of what decides the joint graph and the pass (the Dynamo graph, its
    inputs' metadata, grad and autocast state, the pass's uuid) and recalled on a hit."""
    uuid = hot_pass.uuid()
    if uuid is None:  # caches are bypassed, the pass always runs
        return
    metas = [
        (tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor) else t
        for t in example_inputs
    ]
    autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]
    state = f"{gm.code}|{metas}|{torch.is_grad_enabled()}|{autocast}|{uuid!r}"
    key = hashlib.sha256(state.encode()).hexdigest()
    last = report.last_report()
    if ran and last is not None:
        report.remember(key, last)
    elif not ran:
        compile_id = torch._guards.CompileContext.current_compile_id()
        report.publish(report.recall(key, str(compile_id) if compile_id is not None else NO_COMPILE_ID))


def _showing_partitions(config: HotConfig) -> Callable:
    """Inductor's ``compile_fx_inner``, after showing the graph it gets (dump, ``hot_graphs`` log,
    trace): the partitioned forward and backward exist only between the partitioner and Inductor."""

    def inner_compile(gm: torch.fx.GraphModule, example_inputs, **kwargs):
        from torch._inductor.compile_fx import compile_fx_inner

        if kwargs.get("is_backward"):
            kind = "backward"
        else:
            kind = "inference" if kwargs.get("is_inference") else "forward"
        record_partition(gm, config, kind)
        return compile_fx_inner(gm, example_inputs, **kwargs)

    return inner_compile


def hot(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None = None, options: dict | None = None):
    """The ``"hot"`` backend as torch.compile calls it by name."""
    config, inductor_options = split_options(options)
    return compile_with_hot(gm, example_inputs, config, mode, inductor_options)


def backend(config: HotConfig | None = None, mode: str | None = None, **inductor_options: Any) -> Callable:
    """A backend callable bound to ``config``: ``torch.compile(m, backend=hot_compile.backend(cfg))``.

    ``mode`` ("max-autotune", ...) and keyword arguments (Inductor config options, validated like
    ``options=`` of the named backend) go to Inductor: ``torch.compile`` itself refuses ``mode``
    together with ``options``, and passes neither to a backend callable.
    """
    config = config or HotConfig()
    if not isinstance(config, HotConfig):
        raise ValueError(f"backend() takes a HotConfig, got {type(config).__name__}")
    _, inductor_options = split_options(inductor_options)
    if mode is not None:
        from torch._inductor import list_mode_options

        try:
            list_mode_options(mode)
        except RuntimeError as err:  # Inductor's message names the accepted modes
            raise ValueError(str(err)) from None

    def hot_backend(gm, example_inputs, mode=mode, options=None):
        cfg, extra = split_options(options, base=config)
        return compile_with_hot(gm, example_inputs, cfg, mode, {**inductor_options, **extra})

    return hot_backend
