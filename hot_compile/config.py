"""``HotConfig``: the frozen, validated settings of the HOT rewrite."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from typing import Any

from .plan import PAPER_RANK
from .runtime.aten_impl import DEFAULT_RANK
from .runtime.quant import MAX_BITS, MIN_BITS

POLICIES = ("balanced", "hot", "speed", "memory", "off")
# Keys a per-module override may set.
OVERRIDABLE = (
    "policy", "gx_bits", "gw_bits", "rank", "gx_quantizer", "weight_quantizer", "gw_quantizer", "rewrite_gx",
    "rewrite_gw", "hadamard", "max_slowdown", "exact_loss_head", "forward_bits", "compress_saved",
    "saved_derivative_bits",
)  # fmt: skip
GX_QUANTIZERS = ("per_token", "per_tensor")
WEIGHT_QUANTIZERS = ("per_channel", "stochastic", "sawb")
GW_QUANTIZERS = ("per_channel", "per_tensor")
# gx_bits / gw_bits / forward_bits "auto": the widest bit width the device's integer GEMM runs at its
# narrow operands' rate.
AUTO = "auto"

# The paper's recipe (Kim et al., CVPR 2025; the official code's defaults) on every linear:
# ``torch.compile(m, backend="hot", options={"policy": "hot", **PAPER_RECIPE})``. It stalls a byte-level
# language model (rank 8) and loses accuracy on small models (per-tensor INT4 with SAWB); BENCHMARKS.md.
PAPER_RECIPE = {
    "gx_bits": 4,
    "gx_quantizer": "per_tensor",
    "weight_quantizer": "sawb",
    "gw_quantizer": "per_tensor",
    "rank": PAPER_RANK,
    "exact_loss_head": False,
    "forward_bits": None,
}


def _fail(key: str, value: Any, accepted: str) -> None:
    raise ValueError(f"HotConfig.{key}={value!r} is invalid: accepted values are {accepted}")


def _as_globs(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        _fail(key, value, "a module-path glob or a list of globs (fnmatch syntax, e.g. 'blocks.*.mlp.*')")
    for glob in value:
        if not isinstance(glob, str) or not glob or glob.count("[") != glob.count("]"):
            _fail(key, glob, "non-empty fnmatch globs with balanced [] (e.g. 'head', 'layers.*.fc?')")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class HotConfig:
    """Settings of the HOT joint-graph rewrite.

    Attributes:
        policy: which legal sites to rewrite, judged by the cost model (``passes/cost_model.py``;
            default: env ``HOT_POLICY``, else ``"balanced"``, for pipelines that name the backend
            only by string, like Hugging Face's ``torch_compile_backend="hot"``):
            ``"balanced"`` the paper's recipe unless estimated more than ``max_slowdown`` slower;
            ``"hot"`` the paper's recipe everywhere; ``"speed"`` only where estimated faster;
            ``"memory"`` every grad_weight (to compress its saved activation) and grad_input where
            faster; ``"off"`` nothing: graphs compile as Inductor alone would.
        max_slowdown: the bound of ``"balanced"``: a site is kept when its HOT estimate exceeds
            ``(1 + max_slowdown)`` times the original's.
        overrides: per-module settings, ``{glob: {key: value}}`` with keys among
            ``OVERRIDABLE``; every glob matching a module path applies, later entries winning.
        device_profile: cost-model profile: ``"auto"`` (the calibrated one of this machine, else the
            built-in one matching the device), ``"calibrated"``, or a built-in profile name.
        gx_bits: bit width of both operands of the grad_input product (HQ), 2..8, or ``"auto"``: the
            widest width whose integer GEMM runs at the rate of the narrowest on the site's device
            (8 where int8 is the narrowest hardware type: GPUs, CPUs with VNNI or AMX; 7 on x86 CPUs
            with only AVX2, whose exact uint8 × int8 GEMM takes at most 7-bit operands).
        gw_bits: bit width of both operands of the grad_weight product (HLA) and of the saved buffer
            (ABC), 2..8, or ``"auto"`` (the default): as ``gx_bits``.
        rank: rows kept of each 16-token Walsh block for HLA/ABC, 1..16 (16 = no low-rank error, the
            default: rank 8 is only right where neighbouring tokens are alike, which
            :func:`hot_compile.select_quantizers` measures per layer into ``plan``).
        gx_quantizer: scales of the grad_input gradient: ``"per_token"`` (one per row, free in the
            integer GEMM's epilogue) or ``"per_tensor"`` (the paper's).
        weight_quantizer: how HQ quantizes the transformed weight: ``"per_channel"`` (stochastic
            rounding, one max scale per input feature: unbiased), ``"stochastic"`` (the same with one
            scale), or ``"sawb"`` (the paper's SAWB clip, round-to-nearest: a fixed bias, since the clip
            cuts the tails at any bit width).
        gw_quantizer: scales of both HLA operands: ``"per_channel"`` (one per output feature of the
            gradient, one per input feature of the activation) or ``"per_tensor"`` (the paper's).
        exact_loss_head: leave the backward of a linear whose output feeds a softmax cross-entropy (an
            LM head, a classifier; found in the graph) to Inductor: its gradient, softmax minus
            one-hot, is a few spikes per row, and every layer below inherits its error.
        include: module-path globs to consider (``fnmatch`` against paths like ``blocks.0.mlp.fc1``).
        exclude: module-path globs to leave alone; wins over ``include``.
        forward_bits: not the paper's, which leaves the forward exact: the forward product of each
            linear on integer operands of this width (:func:`hot_compile.runtime.aten_impl.int8_linear`:
            Hadamard-transformed along the contraction, rounded to nearest, one scale per token and
            one per output feature), a row of its own (path ``"fwd"``) under the same policy, cost
            model and loss-head rule. ``"auto"`` (the default) resolves per device as ``gx_bits``
            does; ``None`` leaves the forward to Inductor.
        rewrite_gx: rewrite grad_input products (HQ); off leaves them to Inductor.
        rewrite_gw: rewrite grad_weight products (HLA with ABC); off leaves them and ``x`` as they were.
        hadamard: transform before quantizing in HQ; off quantizes ``g`` and ``W`` as they are (plain
            INT4, the baseline the paper argues against).
        compress_saved: not the paper's: every other float activation the partitioner saves for the
            backward (LayerNorm and residual inputs, attention's query, key, value and output) is
            saved as int8 rows with one float32 scale per row, and a GELU's input as the 4-bit code
            of its derivative, which HOT's encoder computes from that input, and a weight's cast is
            redone in the backward from the parameter instead of saved
            (:mod:`hot_compile.passes.saved_activations`), under every policy but
            ``"speed"`` and ``"off"``; ``"balanced"`` compresses the values that save the most bytes
            per estimated second while the added time stays within ``max_slowdown`` of the step's
            estimated floor (its products as they run, HOT's variants where rewritten, its fused
            attention, and the write and read of what the forward saves); rows of path
            ``"saved"`` in the report. On by default; off saves what the partitioner chose, with no
            rows.
        saved_derivative_bits: with ``compress_saved``, the width of the code a pointwise function's
            derivative (GELU's) is saved in: 4, or None to save that function's input as int8 rows
            like every other value.
        strict: raise on a pass failure instead of warning and compiling the graph unchanged.
        plan: a :class:`~hot_compile.plan.QuantizerPlan` (or the path of one saved as JSON) from
            :func:`hot_compile.select_quantizers`: per-layer ``gx_quantizer`` and, where the data allow it,
            ``rank``; ``overrides`` still win.
        dump_dir: folder for per-graph dumps of what the pass did (default: env ``HOT_DUMP_DIR``).
    """

    policy: str = dataclasses.field(default_factory=lambda: os.environ.get("HOT_POLICY") or "balanced")
    max_slowdown: float = 0.1
    overrides: tuple = ()
    device_profile: str = "auto"
    gx_bits: int | str = AUTO
    gw_bits: int | str = AUTO
    rank: int = DEFAULT_RANK
    gx_quantizer: str = "per_token"
    weight_quantizer: str = "per_channel"
    gw_quantizer: str = "per_channel"
    exact_loss_head: bool = True
    forward_bits: int | str | None = AUTO
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    rewrite_gx: bool = True
    rewrite_gw: bool = True
    hadamard: bool = True
    compress_saved: bool = True
    saved_derivative_bits: int | None = 4
    strict: bool = False
    plan: Any = None
    dump_dir: str | None = dataclasses.field(default_factory=lambda: os.environ.get("HOT_DUMP_DIR") or None)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            _fail("policy", self.policy, " | ".join(map(repr, POLICIES)))
        if isinstance(self.max_slowdown, bool) or not isinstance(self.max_slowdown, (int, float)) or not self.max_slowdown >= 0:
            _fail("max_slowdown", self.max_slowdown, "a number >= 0")
        self._validate_profile()
        for key in ("gx_bits", "gw_bits"):
            value = getattr(self, key)
            if value != AUTO and (type(value) is not int or not MIN_BITS <= value <= MAX_BITS):
                _fail(key, value, f"an int in {MIN_BITS}..{MAX_BITS} or 'auto'")
        if self.forward_bits not in (None, AUTO) and (
            type(self.forward_bits) is not int or not MIN_BITS <= self.forward_bits <= MAX_BITS
        ):
            _fail("forward_bits", self.forward_bits, f"None, 'auto' or an int in {MIN_BITS}..{MAX_BITS}")
        if self.saved_derivative_bits not in (None, 4) or isinstance(self.saved_derivative_bits, bool):
            _fail("saved_derivative_bits", self.saved_derivative_bits, "4 or None")
        if type(self.rank) is not int or not 1 <= self.rank <= 16:
            _fail("rank", self.rank, "an int in 1..16")
        if self.gx_quantizer not in GX_QUANTIZERS:
            _fail("gx_quantizer", self.gx_quantizer, " | ".join(map(repr, GX_QUANTIZERS)))
        if self.weight_quantizer not in WEIGHT_QUANTIZERS:
            _fail("weight_quantizer", self.weight_quantizer, " | ".join(map(repr, WEIGHT_QUANTIZERS)))
        if self.gw_quantizer not in GW_QUANTIZERS:
            _fail("gw_quantizer", self.gw_quantizer, " | ".join(map(repr, GW_QUANTIZERS)))
        for key in ("rewrite_gx", "rewrite_gw", "hadamard", "compress_saved", "strict", "exact_loss_head"):
            if type(getattr(self, key)) is not bool:
                _fail(key, getattr(self, key), "True or False")
        if self.dump_dir is not None:
            if not isinstance(self.dump_dir, (str, os.PathLike)) or not os.fspath(self.dump_dir):
                _fail("dump_dir", self.dump_dir, "None or a non-empty folder path")
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))
        object.__setattr__(self, "include", _as_globs("include", self.include))
        object.__setattr__(self, "exclude", _as_globs("exclude", self.exclude))
        object.__setattr__(self, "overrides", self._normalized_overrides())
        object.__setattr__(self, "plan", self._loaded_plan())

    def _loaded_plan(self):
        from .plan import QuantizerPlan

        if self.plan is None or isinstance(self.plan, QuantizerPlan):
            return self.plan
        if isinstance(self.plan, (str, os.PathLike)):
            try:
                return QuantizerPlan.load(self.plan)
            except (OSError, ValueError, TypeError, KeyError) as err:
                raise ValueError(f"HotConfig.plan={os.fspath(self.plan)!r} could not be read: {err}") from None
        _fail("plan", self.plan, "None, a QuantizerPlan, or the path of one saved as JSON")

    def _validate_profile(self) -> None:
        from .runtime.devices import BUILTIN_PROFILES

        accepted = ("auto", "calibrated", *BUILTIN_PROFILES)
        if self.device_profile not in accepted:
            _fail("device_profile", self.device_profile, " | ".join(map(repr, accepted)))

    def _normalized_overrides(self) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
        """``overrides`` as a hashable tuple of ``(glob, ((key, value), ...))`` in the given order."""
        entries = self.overrides.items() if isinstance(self.overrides, dict) else self.overrides
        if not isinstance(entries, (tuple, list, type({}.items()))):
            _fail("overrides", self.overrides, "a dict {glob: {key: value}} or a list of (glob, dict) pairs")
        normalized = []
        for entry in entries:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
                _fail("overrides", entry, "(glob, {key: value}) pairs")
            glob, values = entry
            (glob,) = _as_globs("overrides", glob)
            values = dict(values)
            bad = sorted(set(values) - set(OVERRIDABLE))
            if bad:
                _fail(f"overrides[{glob!r}]", bad, f"keys among {list(OVERRIDABLE)}")
            try:
                dataclasses.replace(self, overrides=(), **values)  # validates each value as its field
            except ValueError as err:
                raise ValueError(f"HotConfig.overrides[{glob!r}]: {err}") from None
            normalized.append((glob, tuple(sorted(values.items()))))
        return tuple(normalized)

    def source(self, module_path: str, key: str) -> str:
        """Where ``module_path``'s setting ``key`` comes from: ``"override"``, ``"plan"`` or ``"config"``."""
        if any(fnmatch.fnmatchcase(module_path, glob) and key in dict(values) for glob, values in self.overrides):
            return "override"
        if self.plan is not None and key in self.plan.settings_for(module_path):
            return "plan"
        return "config"

    def for_module(self, module_path: str) -> HotConfig:
        """This config for ``module_path``: the plan's settings for it (quantizer, rank), then every
        override whose glob matches, in order."""
        changes: dict[str, Any] = dict(self.plan.settings_for(module_path)) if self.plan is not None else {}
        for glob, values in self.overrides:
            if fnmatch.fnmatchcase(module_path, glob):
                changes.update(values)
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> HotConfig:
        unknown = set(changes) - set(self.fields())
        if unknown:
            raise ValueError(f"unknown HotConfig key(s) {sorted(unknown)}: accepted keys are {list(self.fields())}")
        return dataclasses.replace(self, **changes)

    def any_module(self, key: str) -> bool:
        """Whether ``key`` is true in this config or in any override (a setting some module may get)."""
        return bool(getattr(self, key)) or any(dict(values).get(key) for _, values in self.overrides)

    def selects(self, module_path: str) -> bool:
        """Whether ``module_path`` passes the include/exclude globs."""
        return any(fnmatch.fnmatchcase(module_path, g) for g in self.include) and not any(
            fnmatch.fnmatchcase(module_path, g) for g in self.exclude
        )


def split_options(options: dict[str, Any] | None, base: HotConfig | None = None) -> tuple[HotConfig, dict[str, Any]]:
    """Split ``torch.compile(options=...)`` into a HotConfig and the remaining Inductor options.

    A key that is neither a HotConfig field nor an Inductor config key raises ``ValueError``.
    """
    import torch._inductor.config as inductor_config

    hot: dict[str, Any] = {}
    inductor: dict[str, Any] = {}
    inductor_keys = inductor_config.get_config_copy()
    for key, value in (options or {}).items():
        if key in HotConfig.fields():
            hot[key] = value
        elif key.replace("-", "_") in inductor_keys:
            inductor[key.replace("-", "_")] = value
        else:
            raise ValueError(
                f"unknown option {key!r}: accepted are the HOT keys {list(HotConfig.fields())} "
                "or any torch._inductor.config key"
            )
    return (base or HotConfig()).replace(**hot), inductor
