"""HOT's CPU library built for the CPU classes this machine is not, so that their vector code runs in
the suite too: the AVX2 build (AMD EPYCs without AVX-512) and the plain x86-64 one
(:data:`hot_compile.runtime.devices.CPU_CLASSES`). A CPU runs the builds of the classes below its own,
so an AVX-512 machine tests all three."""

from __future__ import annotations

import ctypes
import functools
import pathlib
import platform

import pytest

from hot_compile.runtime import cpu_kernels
from hot_compile.runtime.devices import CPU_CLASSES

BUILDS = tuple(CPU_CLASSES)


@functools.cache
def library(name: str, folder: pathlib.Path) -> ctypes.CDLL:
    """The library built in ``folder`` for the CPU class ``name``
    (:func:`hot_compile.runtime.cpu_kernels.compile_for_class`); the test is skipped where this machine
    cannot run that build."""
    flag = CPU_CLASSES[name][1]
    if platform.machine() != "x86_64" or flag not in pathlib.Path("/proc/cpuinfo").read_text().split():
        pytest.skip(f"the {name} build of HOT's CPU library runs on x86-64 CPUs with {flag}")
    return cpu_kernels.bind(cpu_kernels.compile_for_class([p.read_text() for p in cpu_kernels._SOURCES], name, folder))
