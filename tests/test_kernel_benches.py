"""The kernel tools on tiny operands: ``tools/int8_gemm_bench.py`` measures every column it reports, its
``hot`` column the GEMM HOT's ops run; ``tools/quantizer_bench.py`` runs each kernel on this tree's
library and on the one it is set against."""

import torch

from hot_compile.runtime import cpu_gemm, cpu_kernels
from tests import cpu_builds, tool_scripts


def test_int8_gemm_bench_measures_each_column(monkeypatch):
    bench = tool_scripts.load("int8_gemm_bench")
    monkeypatch.setattr(bench, "SHAPES", (("tiny", 40, 96, 24, ("rows", "cols")),))
    engine = cpu_gemm.fused_gemm()
    (row,) = bench.measure(1, engine)
    measured = {key.removesuffix("_ms") for key in row if key.endswith("_ms") and not key.endswith("_min_ms")}
    assert measured == {"hot", *bench._columns(engine)}
    assert all(row[f"{key}_ms"] > 0 for key in measured)
    assert ("own" in measured) == (engine == "vnni") and ("int_mm" in measured) == bool(engine)


def test_int8_gemm_bench_runs_the_avx2_engine_on_its_operands(monkeypatch, cpu_build_folder):
    """On an AVX2 build the ``hot`` column is HOT's AVX2 GEMM: its codes are within the engine's bound."""
    bench = tool_scripts.load("int8_gemm_bench")
    monkeypatch.setattr(bench, "SHAPES", (("tiny", 40, 96, 24, ("rows", "cols")),))
    library, engines = cpu_builds.library("avx2", cpu_build_folder), []

    class Recording:  # the engine each call of HOT's GEMM names
        def __getattr__(self, name):
            kernel = getattr(library, name)
            return (lambda *args: engines.append(args[-1]) or kernel(*args)) if name == "hot_matmul_dequantize" else kernel

    monkeypatch.setattr(cpu_kernels, "library", Recording)
    monkeypatch.setattr(cpu_gemm, "fused_gemm", lambda: "avx2")
    (row,) = bench.measure(1, "avx2")
    assert row["hot_ms"] > 0 and row["int_mm_ms"] > 0 and row["float_ms"] > 0
    assert engines and set(engines) == {cpu_gemm._GEMM_ENGINES["avx2"]}


def test_quantizer_bench_runs_each_kernel_on_both_libraries(monkeypatch):
    bench = tool_scripts.load("quantizer_bench")
    monkeypatch.setattr(bench, "SHAPES", (("tiny", 40, 64),))
    library, used = cpu_kernels.library(), set()

    class Against:
        def __getattr__(self, name):
            used.add(name)
            return getattr(library, name)

    rows = bench.measure(1, Against())
    assert {row["kernel"] for row in rows} == set(bench._kernels(torch.zeros(1, 16)))
    assert all(row["this_ms"] > 0 and row["against_ms"] > 0 for row in rows)
    assert {"hot_rows_quantize", "hot_rows_encode", "hot_derivative_encode", "hot_cols_stats", "hot_cols_quantize"} <= used
