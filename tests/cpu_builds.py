"""HOT's CPU library built for the CPU classes this machine is not, so that their vector code runs in
the suite too: the AVX2 build (AMD EPYCs without AVX-512) and the plain x86-64 one
(:data:`hot_compile.runtime.devices.CPU_CLASSES`). A CPU runs the builds of the classes below its own,
so an AVX-512 machine tests all three."""

from __future__ import annotations

import ctypes
import functools
import pathlib

import pytest

from hot_compile.runtime import attention_ops, cpu_gemm, cpu_kernels
from hot_compile.runtime.devices import CPU_CLASSES, runs_here

BUILDS = tuple(CPU_CLASSES)


@functools.cache
def library(name: str, folder: pathlib.Path) -> ctypes.CDLL:
    """The library built in ``folder`` for the CPU class ``name``
    (:func:`hot_compile.runtime.cpu_kernels.compile_for_class`); the test is skipped where this machine
    cannot run that build."""
    if not runs_here(name):
        pytest.skip(f"the {name} build of HOT's CPU library runs on x86-64 CPUs with {CPU_CLASSES[name][1]}")
    return cpu_kernels.bind(cpu_kernels.compile_for_class([p.read_text() for p in cpu_kernels._SOURCES], name, folder))


def use(library: ctypes.CDLL, monkeypatch) -> None:
    """Run HOT's CPU ops on ``library``, with what the runtime caches of the library asked again of it."""
    monkeypatch.setattr(cpu_kernels, "library", lambda: library)
    for module, name in ((cpu_gemm, "fused_gemm"), (attention_ops, "bf16_attention_backward")):
        monkeypatch.setattr(module, name, functools.cache(getattr(module, name).__wrapped__))
