"""``tools/int8_gemm_bench.py`` on a tiny product: every column it reports is measured, and its
``hot`` column is the GEMM HOT's ops run."""

from hot_compile.runtime import cpu_kernels
from tests import tool_scripts


def test_int8_gemm_bench_measures_each_column(monkeypatch):
    bench = tool_scripts.load("int8_gemm_bench")
    monkeypatch.setattr(bench, "SHAPES", (("tiny", 40, 96, 24, ("rows", "cols")),))
    engine = cpu_kernels.fused_gemm()
    (row,) = bench.measure(1, engine)
    measured = {key.removesuffix("_ms") for key in row if key.endswith("_ms") and not key.endswith("_min_ms")}
    assert measured == {"hot", *bench._columns(engine)}
    assert all(row[f"{key}_ms"] > 0 for key in measured)
    assert ("own" in measured) == (engine == "vnni") and ("int_mm" in measured) == bool(engine)
