"""HOT's CPU library gives the same bits on every CPU class: the AVX2 and plain x86-64 builds
(:mod:`tests.cpu_builds`) against this machine's, kernel by kernel, on values that reach every branch
(each dtype, NaN, a zero row, tails short of a vector and of a block). Codes that match bit for bit
make a training run's noise and levels the same on each class, so fidelity measured on one holds on
the others."""

import pytest
import torch

from hot_compile.runtime import attention_ops, cpu_kernels, quant
from tests import cpu_builds

OFFSET = quant.noise_offset(5, 1)


def _values(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(301, 390, generator=torch.Generator().manual_seed(0)) * 3
    x[3, 5] = float("nan")
    x[7] = 0
    return x.to(dtype)


def _kernel_outputs() -> list[torch.Tensor]:
    outs: list[torch.Tensor] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _values(dtype)
        for bits in (4, 7, 8):
            for stochastic in (True, False):
                outs += cpu_kernels.quantize_rows(x, bits, width=400, hadamard=True, per_row=True, stochastic=stochastic, offset=OFFSET)
                outs += cpu_kernels.quantize_rows(x, bits, width=390, hadamard=False, per_row=False, stochastic=stochastic, offset=OFFSET)
        outs += [*cpu_kernels.encode_rows(x, 8), *cpu_kernels.encode_rows(x[:, :37], 4)]
        for function in ("gelu", "gelu_tanh", cpu_kernels.GIVEN):
            outs += cpu_kernels.encode_derivative(x, OFFSET, function, 4)
        outs += [cpu_kernels.derivative(x, "gelu"), cpu_kernels.derivative(x, "gelu_tanh")]
        outs += attention_ops.attention_probabilities(x.float() - 4, x.float(), dtype)
    walsh = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(16)] for i in range(4)])
    dense = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    for x in (_values(torch.float32)[:, :200], _values(torch.bfloat16)[:, :200], _values(torch.float32)[:200].t()):
        for basis, tail in ((walsh, None), (dense, dense.flip(0))):
            rows = (x.shape[0] // 16 + (tail is not None)) * basis.shape[0]  # every row the pass writes
            scale = torch.linspace(0.5, 1.5, x.shape[1])
            outs += cpu_kernels.column_moments(x, basis, tail, rows)
            outs.append(cpu_kernels.quantize_columns(x, basis, tail, rows, 8, scale, stochastic=True, offset=OFFSET))
            outs.append(cpu_kernels.quantize_columns(x, basis, tail, rows - 3, 7, scale, stochastic=False, column_major=True))
    return outs


@pytest.mark.parametrize("build", list(cpu_builds.BUILDS))
def test_each_cpu_class_build_gives_this_machines_bits(build, monkeypatch, cpu_build_folder):
    library = cpu_builds.library(build, cpu_build_folder)
    expected = _kernel_outputs()
    monkeypatch.setattr(cpu_kernels, "library", lambda: library)
    got = _kernel_outputs()
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        if a.is_floating_point():  # by the bits: NaN where the other has NaN, and the same NaN
            bits = torch.int16 if a.element_size() == 2 else torch.int32
            a, b = a.view(bits), b.view(bits)
        assert torch.equal(a, b), f"output {i} differs on the {build} build"
