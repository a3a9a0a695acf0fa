"""Per-site numerics: settings the config leaves to the device resolved, and a row's description."""

from __future__ import annotations

import dataclasses

import torch

from ..config import AUTO, HotConfig
from ..runtime import cpu_gemm, int8_gemm
from ..runtime.devices import DeviceProfile, cpu_class
from ..runtime.hadamard import lowpass_rows, padded_length
from ..runtime.quant import qmax

# What a row says of an integer product that does not run on the hardware's int8 GEMM.
_GEMM_NOTES = {
    "int_mm": "",
    "u8s8": "; GEMM: oneDNN uint8 × int8 (no VNNI/AMX int8 GEMM on this CPU)",
    "float32": "; GEMM: float32 on the integer values, exact (no int8 GEMM on this device)",
    "float32 pieces": "; GEMM: float32 on the integer values in exact pieces (no int8 GEMM on this device)",
}
# HOT's own CPU GEMM (cpu_gemm.gemm_engine), where it runs the product.
_ENGINE_NOTES = {"amx": "", "vnni": "", "avx2": "; GEMM: HOT's uint8 × int8 on AVX2 (no VNNI/AMX int8 GEMM on this CPU)"}


def resolve_numerics(config: HotConfig, profile: DeviceProfile) -> HotConfig:
    """``config`` with ``gx_bits``, ``gw_bits`` and ``forward_bits`` ``"auto"`` replaced by the widest bit
    width that costs no more than the narrowest on ``profile``'s device: INT4 operands run through the
    same int8 kernels wherever INT4 has no GEMM of its own, so the narrower width would only add
    rounding error."""
    widest = profile.widest_bits_at_narrowest_rate()
    resolved = {key: widest for key in ("gx_bits", "gw_bits", "forward_bits") if getattr(config, key) == AUTO}
    return dataclasses.replace(config, **resolved) if resolved else config


def _with_source(value: object, source: str) -> str:
    return str(value) if source == "config" else f"{value} ({source})"


def _bits(site: HotConfig, config: HotConfig, module_path: str, key: str) -> str:
    """``INTb`` of ``site``'s ``key``, with its source: the device where ``config`` left it ``"auto"``."""
    source = config.source(module_path, key)
    if source == "config" and getattr(config, key) == AUTO:
        source = "auto: device"
    return _with_source(f"INT{getattr(site, key)}", source)


def describe(path: str, site: HotConfig, config: HotConfig, module_path: str) -> str:
    """What a rewritten ``path`` site computes under its resolved config ``site``, each choice with its
    source where it is not ``config``'s own value (the device, the plan, an override)."""
    if path == "fwd":
        return f"{_bits(site, config, module_path, 'forward_bits')} x per_token, W per_channel, nearest"
    if path == "gx":
        bits = _bits(site, config, module_path, "gx_bits")
        g = _with_source(site.gx_quantizer, config.source(module_path, "gx_quantizer"))
        w = _with_source(site.weight_quantizer, config.source(module_path, "weight_quantizer"))
        hadamard = "" if site.hadamard else ", no Hadamard"
        return f"{bits} g {g}, W {w}{hadamard}"
    bits = _bits(site, config, module_path, "gw_bits")
    rank = _with_source(f"rank {site.rank}", config.source(module_path, "rank"))
    scales = _with_source(site.gw_quantizer, config.source(module_path, "gw_quantizer"))
    return f"{bits} {rank} {scales}"


def gemm_note(path: str, site: HotConfig, shapes: tuple[int, int, int], device: torch.device) -> str:
    """The integer GEMM a rewritten ``path`` product of an ``(L, N, K)`` linear runs, where it is not the
    device's int8 one: HOT's own CPU GEMM where it runs the product (on VNNI, ``torch._int_mm`` where it
    leaves it), else :func:`~hot_compile.runtime.int8_gemm.gemm_path`'s. A slower GEMM is never silent."""
    l, n, k = shapes
    if path == "fwd":
        bits, contraction = site.forward_bits, padded_length(k)
    elif path == "gx":
        bits, contraction = site.gx_bits, padded_length(n) if site.hadamard else n
    else:
        bits, contraction = site.gw_bits, lowpass_rows(l, site.rank)
    if device.type == "cpu" and int8_gemm.CPU_INT8_INSTRUCTIONS and cpu_class() == "native":
        # This CPU's build has the VNNI or AMX engine, which runs or leaves to torch._int_mm every
        # product: answered without waiting, in the pass, for the library the pass starts building.
        return ""
    engine = cpu_gemm.gemm_engine(qmax(bits)) if device.type == "cpu" else ""
    if engine:
        return _ENGINE_NOTES[engine]
    return _GEMM_NOTES[int8_gemm.gemm_path(device, contraction, qmax(bits), qmax(bits))]
