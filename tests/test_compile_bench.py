"""The cross-process compile-time benchmark: which process compiles with which cache, and its figures.

The orchestration runs with a recording child runner (the real one starts a Python process per compile,
tens of seconds each); :func:`measure`, what a child process runs, runs here on a small Inductor case.
No timing is asserted.
"""

import pathlib

import pytest

from hot_compile.harness import compile_bench


def test_each_compile_gets_a_new_cache_shared_only_with_its_backends_primer():
    calls = []

    def run_child(variant, model, batch, cache_dir):
        calls.append((variant, model, batch, cache_dir))
        assert cache_dir.is_dir()
        hot, primed = variant == "hot-fp32", len(calls) % 6 in (4, 0)  # the last two pairs prime
        compile_s = (12.0 if primed else 20.0) if hot else 10.0
        return {"compile_s": compile_s, "kernel_s": float(hot), "step_s": 0.5, "cache_hits": 3, "cache_misses": 2}

    spec = compile_bench.CompileBenchSpec(model="vit", repeats=2)
    result = compile_bench.run(spec, run_child, log=lambda s: None)

    assert len(calls) == 12
    for repeat in (calls[:6], calls[6:]):
        inductor, hot, inductor_primer, inductor_primed, hot_primer, hot_primed = repeat
        assert [c[:3] for c in repeat] == [
            ("inductor-fp32", "vit", None),
            ("hot-fp32", "vit", None),
            ("inductor-fp32", compile_bench.PRIMER, compile_bench.PRIMER_BATCH),
            ("inductor-fp32", "vit", None),
            ("hot-fp32", compile_bench.PRIMER, compile_bench.PRIMER_BATCH),
            ("hot-fp32", "vit", None),
        ]
        # Each backend's primer fills the cache of that backend's next compile, and no other.
        assert inductor_primer[3] == inductor_primed[3] and hot_primer[3] == hot_primed[3]
        assert len({inductor[3], hot[3], inductor_primer[3], hot_primer[3]}) == 4
    assert not any(pathlib.Path(c[3]).exists() for c in calls)
    assert result["median_hot_vs_inductor"] == {"first_use": 2.0, "after_primer": 1.2}
    table = compile_bench.markdown(result, "python tools/compile_time.py")
    assert "**2.00** on first use, **1.20** after a primer" in table
    assert table.count("\n| ") == 5  # header and two scenarios per repeat
    assert "| 2 | after primer | 10.0 | 12.0 | 1.0 | 1.20 | 3/2 | 3/2 |" in table


def test_bf16_compiles_both_backends_under_autocast():
    variants = []

    def run_child(variant, model, batch, cache_dir):
        variants.append(variant)
        return {"compile_s": 1.0, "kernel_s": 0.0, "step_s": 0.5, "cache_hits": 0, "cache_misses": 2}

    result = compile_bench.run(compile_bench.CompileBenchSpec(model="mlp", repeats=1, precision="bf16"), run_child, log=lambda s: None)
    assert set(variants) == {"inductor-bf16", "hot-bf16"} and len(variants) == 6
    assert "Model: mlp (bench.py's sizes), bf16;" in compile_bench.markdown(result)


def test_a_failing_child_names_the_compile():
    spec = compile_bench.CompileBenchSpec()

    def run_child(variant, model, batch, cache_dir):
        raise RuntimeError(f"{variant} on {model} failed")

    with pytest.raises(RuntimeError, match="inductor-fp32 on vit failed"):
        compile_bench.run(spec, run_child, log=lambda s: None)


def test_spec_rejects_an_unknown_model_and_empty_runs():
    with pytest.raises(ValueError, match="model='resnet'"):
        compile_bench.CompileBenchSpec(model="resnet")
    with pytest.raises(ValueError, match="repeats and steps"):
        compile_bench.CompileBenchSpec(repeats=0)
    with pytest.raises(ValueError, match="precision='fp16'"):
        compile_bench.CompileBenchSpec(precision="fp16")


def test_measure_reports_compile_time_and_no_kernels_for_inductor(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    figures = compile_bench.measure("inductor-fp32", "mlp", batch=1, steps=1, hot_policy="hot")
    assert figures["compile_s"] > 0 and figures["step_s"] > 0 and figures["kernel_s"] == 0
    # A new cache: the forward and backward graphs are compiled, none is found.
    assert (figures["cache_hits"], figures["cache_misses"]) == (0, 2)
