"""HOT's CPU library gives the same bits on every CPU class: the AVX2 and plain x86-64 builds
(:mod:`tests.cpu_builds`) against this machine's, kernel by kernel, on values that reach every branch
(each dtype, NaN, a zero row, tails short of a vector and of a block). Codes that match bit for bit
make a training run's noise and levels the same on each class, so fidelity measured on one holds on
the others."""

import pytest
import torch

from hot_compile.runtime import attention_ops, cpu_gemm, cpu_kernels, int8_gemm, quant
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
    a = torch.randint(-128, 128, (300, 200), generator=torch.Generator().manual_seed(2)).to(torch.int8)
    b = torch.randint(-64, 65, (200, 70), generator=torch.Generator().manual_seed(3)).to(torch.int8)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):  # on each build's own GEMM, if it has one
        outs.append(cpu_gemm.matmul_dequantized(a, b, torch.rand(300, generator=torch.Generator().manual_seed(4)), torch.linspace(0.5, 1.5, 70), 3, out_dtype, int8_gemm.int8_matmul, torch.linspace(-1, 1, 70), b_max=64))
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
    cpu_builds.use(library, monkeypatch)
    got = _kernel_outputs()
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        if a.is_floating_point():  # by the bits: NaN where the other has NaN, and the same NaN
            bits = torch.int16 if a.element_size() == 2 else torch.int32
            a, b = a.view(bits), b.view(bits)
        assert torch.equal(a, b), f"output {i} differs on the {build} build"


def test_the_avx2_engine_is_exact_at_its_bound_and_leaves_wider_operands(monkeypatch, cpu_build_folder):
    """The AVX2 build's own GEMM sums pairs of products in int16: exact with A at its extremes and
    ``|b| = 64`` (each pair 2 · 255 · 64 < 2^15 once A is offset by 128); for a wider ``b`` the product
    runs ``matmul``."""
    cpu_builds.use(cpu_builds.library("avx2", cpu_build_folder), monkeypatch)
    assert cpu_gemm.fused_gemm() == "avx2"
    signs = torch.randint(0, 2, (48 + 40, 320), generator=torch.Generator().manual_seed(0)).bool()
    # Every pair of A's extremes next to every pair of ±64 in B: as uint8, A is 0 or 255.
    a = torch.where(signs[:48], 127, -128).to(torch.int8)
    b = torch.where(signs[48:], 64, -64).to(torch.int8).t()
    calls = []

    def matmul(x, y):
        calls.append(x.shape)
        return int8_gemm.int8_matmul(x, y)

    ones = torch.ones(48), torch.ones(40)
    exact = (a.double() @ b.double()).float()
    assert torch.equal(cpu_gemm.matmul_dequantized(a, b, *ones, 1, torch.float32, matmul, b_max=64), exact)
    assert calls == []
    assert torch.equal(cpu_gemm.matmul_dequantized(a, b, *ones, 1, torch.float32, matmul, b_max=65), exact)
    assert calls == [(48, 320)]


def test_hot_cpu_class_runs_that_class_build_and_profile(monkeypatch, tmp_path):
    """``HOT_CPU_CLASS=avx2`` makes HOT load its AVX2 build (kept apart from this machine's, and
    without VNNI's engine even on a CPU that has it) and cost with the AVX2 class's profile."""
    from hot_compile.runtime import devices

    if not devices.runs_here("avx2"):
        pytest.skip("the AVX2 class's code runs on CPUs with AVX2")
    monkeypatch.setenv("HOT_CACHE_DIR", str(tmp_path))
    native_path = cpu_kernels.library_path()
    monkeypatch.setenv("HOT_CPU_CLASS", "avx2")
    assert devices.resolve_profile(torch.device("cpu")).name == "cpu-avx2-2core"
    assert cpu_kernels.library_path() != native_path
    library = cpu_kernels._load()
    assert library.hot_gemm_engines() == cpu_gemm._GEMM_ENGINES["avx2"] and cpu_kernels.library_path().exists()
    monkeypatch.setenv("HOT_CPU_CLASS", "avx3")
    with pytest.raises(ValueError, match="HOT_CPU_CLASS='avx3'"):
        cpu_kernels.library_path()
