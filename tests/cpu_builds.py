"""HOT's CPU library built for the CPU classes this machine is not, so that their vector code runs in
the suite too: the AVX2 build (AMD EPYCs without AVX-512) and the plain x86-64 one. A CPU runs the
builds of the classes below its own, so an AVX-512 machine tests all three."""

from __future__ import annotations

import ctypes
import functools
import pathlib
import platform
import subprocess

import pytest
from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
from torch._inductor.cpu_vec_isa import VecAVX2, invalid_vec_isa

from hot_compile.runtime import cpu_kernels

# name: (GCC's -march in place of Inductor's -march=native, Inductor's vector ISA, the CPU flag it needs)
BUILDS = {"avx2": ("x86-64-v3", VecAVX2(), "avx2"), "x86-64": ("x86-64", invalid_vec_isa, "sse2")}


@functools.cache
def library(name: str, folder: pathlib.Path) -> ctypes.CDLL:
    """The library built in ``folder`` with Inductor's own command for its C++ kernels (as
    :func:`hot_compile.runtime.cpu_kernels.compile_sources` builds it) but for the CPU class ``name``;
    the test is skipped where this machine cannot run that build."""
    march, isa, flag = BUILDS[name]
    if platform.machine() != "x86_64" or flag not in pathlib.Path("/proc/cpuinfo").read_text().split():
        pytest.skip(f"the {name} build of HOT's CPU library runs on x86-64 CPUs with {flag}")
    source = folder / f"kernels_{name}.cpp"
    source.write_text("\n".join(p.read_text() for p in cpu_kernels._SOURCES))
    options = CppTorchDeviceOptions(vec_isa=isa, device_type="cpu", extra_flags=())
    command = CppBuilder(name=source.stem, sources=str(source), BuildOption=options, output_dir=str(folder)).get_command_line()
    assert "-march=native" in command, command
    done = subprocess.run(command.replace("-march=native", f"-march={march}"), shell=True, cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return cpu_kernels.bind(ctypes.CDLL(str(folder / f"{source.stem}.so")))
