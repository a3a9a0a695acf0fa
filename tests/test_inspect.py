"""Seeing what HOT did: dump folders, TORCH_LOGS, TORCH_TRACE and ``hot-compile explain``.

Most tests compile through AOTAutograd alone (``aot_hot_backend``, which shows the partitioned graphs
the way the ``hot`` backend does); one explain test goes through Inductor end to end.
"""

import json
import os
import subprocess
import sys
import textwrap
import warnings
import xml.etree.ElementTree as ET

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table

import hot_compile
from hot_compile import HotConfig, cli
from hot_compile.inductor_pass import HotJointPass
from hot_compile.observability import inspection
from tests.models import MLP, Block

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOT = HotConfig(strict=True, policy="hot")  # rewrite every legal site, whatever the cost model says


def aot_hot_backend(config: HotConfig):
    """The HOT pass on the joint graph and the partitioned graphs shown, as ``backend="hot"`` does,
    but compiled by AOTAutograd alone (no Inductor codegen)."""
    hot_pass = HotJointPass(config)

    def partition(joint, inputs, **kwargs):
        hot_pass(joint.graph)
        joint.recompile()
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    def showing(kind):
        def compile_graph(gm, _):
            inspection.record_partition(gm, config, kind)
            return make_boxed_func(gm)

        return compile_graph

    return aot_autograd(
        fw_compiler=showing("forward"),
        bw_compiler=showing("backward"),
        partition_fn=partition,
        decompositions=select_decomp_table(),
    )


def mlp_step():
    """An explain target: (model, example_inputs)."""
    torch.manual_seed(0)
    return MLP(), torch.randn(2, 32, 32, requires_grad=True)


def _train_step(model, x, config):
    torch.compile(model, backend=aot_hot_backend(config))(x).square().mean().backward()


def _read(folder, name):
    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("model,shape", [(MLP, (2, 32, 32)), (Block, (2, 32, 32))], ids=["mlp", "block"])
def test_dump_holds_graphs_report_and_picture(tmp_path, model, shape):
    _train_step(model(), torch.randn(*shape, requires_grad=True), HOT.replace(dump_dir=str(tmp_path)))
    folder = tmp_path / "0_0"
    assert sorted(os.listdir(folder)) == sorted(inspection.DUMP_FILES)

    before, after = _read(folder, "joint_before.py"), _read(folder, "joint_after.py")
    assert "torch.ops.hot_compile" not in before
    assert "torch.ops.hot_compile.hq_grad_input.default" in after
    for rewrite in ("hq_grad_input", "hla_grad_weight", "compress_activation"):
        assert f"# hot_compile: {{'rewrite': '{rewrite}'" in after  # provenance kept in the dump
    assert "hot_compile/harness/models.py" in before and 'f32[64, 32]' in before  # source lines, FakeTensor annotations
    assert "'rewrite': 'compress_activation'" in _read(folder, "forward.py")
    assert "torch.ops.hot_compile.hla_grad_weight.default" in _read(folder, "backward.py")

    report = hot_compile.last_report()
    saved = json.loads(_read(folder, "report.json"))
    assert saved["graph"] == report.graph == "0/0" and saved["error"] is None
    assert saved["rows"] == [row.as_dict() for row in report.rows]
    assert {(r["rewrite"], r["path"]) for r in saved["rewrites"]} == {
        ("int8_linear", "fwd"),
        ("hq_grad_input", "gx"),
        ("hla_grad_weight", "gw"),
        ("compress_activation", "gw"),
    }
    markdown = _read(folder, "report.md")
    assert inspection.summary(report) in markdown
    assert markdown.count("| HQ |") == len(report.select(decision="HQ")) > 0

    svg = ET.fromstring(_read(folder, "backward.svg"))
    titles = [el.text for el in svg.iter("{http://www.w3.org/2000/svg}title")]
    # one box per rewrite, its tooltip carrying the provenance
    assert sum("'rewrite': 'hq_grad_input'" in t for t in titles) == len(report.select(path="gx", decision="HQ"))


def test_identical_files_are_not_rewritten(tmp_path):
    config = HOT.replace(dump_dir=str(tmp_path))
    _train_step(MLP(), torch.randn(2, 32, 32), config)
    folder = tmp_path / "0_0"
    contents = {name: _read(folder, name) for name in os.listdir(folder)}
    assert "torch.ops.hot_compile.hq_grad_input" in contents["joint_after.py"]
    os.utime(folder / "report.md", ns=(1, 1))  # any rewrite would move it off this time
    os.utime(folder / "backward.py", ns=(1, 1))

    torch._dynamo.reset()
    _train_step(MLP(), torch.randn(2, 32, 32), config)
    assert {name: _read(folder, name) for name in os.listdir(folder)} == contents
    assert os.stat(folder / "report.md").st_mtime_ns == 1 and os.stat(folder / "backward.py").st_mtime_ns == 1

    torch._dynamo.reset()
    _train_step(MLP(), torch.randn(2, 32, 32), config.replace(gx_bits=4))
    assert os.stat(folder / "report.md").st_mtime_ns != 1  # the settings changed: rewritten


def test_caches_are_bypassed_only_while_someone_looks(tmp_path):
    assert isinstance(HotJointPass(HOT).uuid(), bytes)
    assert HotJointPass(HOT.replace(dump_dir=str(tmp_path))).uuid() is None
    with inspection.collect():
        assert HotJointPass(HOT).uuid() is None
    assert isinstance(HotJointPass(HOT).uuid(), bytes)


def test_dump_folder_names():
    assert inspection.dump_folder_name(torch._guards.CompileId(frame_id=0, frame_compile_id=1)) == "0_1"
    assert inspection.dump_folder_name(None) == inspection.NO_COMPILE_ID


def test_a_failing_dump_warns_and_training_goes_on(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    model, x = MLP(), torch.randn(2, 32, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_step(model, x, HOT.replace(strict=False, dump_dir=str(not_a_folder)))
    messages = [str(w.message) for w in caught if issubclass(w.category, inspection.HotInspectionWarning)]
    assert any("could not write the HOT dump" in m for m in messages)
    assert model.fc1.weight.grad is not None
    assert len(hot_compile.last_report().select(path="gx", decision="HQ")) == 1  # the pass itself went through

    torch._dynamo.reset()
    with pytest.raises(Exception, match="could not|File exists|Not a directory"):
        _train_step(MLP(), x, HOT.replace(dump_dir=str(not_a_folder)))


def test_a_failed_pass_is_dumped_unchanged(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(hot_compile.inductor_pass, "run_hot_pass", broken)
    failed_before = counters["hot"]["graphs_failed"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_step(MLP(), torch.randn(2, 32, 32), HOT.replace(strict=False, dump_dir=str(tmp_path)))
    assert any(issubclass(w.category, hot_compile.HotPassWarning) for w in caught)
    assert counters["hot"]["graphs_failed"] == failed_before + 1
    folder = tmp_path / "0_0"
    assert _read(folder, "joint_before.py") == _read(folder, "joint_after.py")
    assert "injected failure" in _read(folder, "report.md")
    assert json.loads(_read(folder, "report.json"))["error"] == "RuntimeError: injected failure"


def test_torch_logs_and_torch_trace(tmp_path):
    script = textwrap.dedent(
        """
        import torch
        from hot_compile import HotConfig
        from tests.models import MLP
        from tests.test_inspect import aot_hot_backend

        model = torch.compile(MLP(), backend=aot_hot_backend(HotConfig(policy="hot", strict=True)))
        model(torch.randn(2, 32, 32, requires_grad=True)).sum().backward()
        """
    )
    trace_dir = tmp_path / "trace"
    env = dict(os.environ, TORCH_LOGS="+hot_compile,hot_decisions", TORCH_TRACE=str(trace_dir), PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stderr
    # the module log: a summary line per graph (INFO) and a decision per site (DEBUG)
    assert "[0/0] HOT pass: 6 linear product site(s): 6 rewritten (2 HLA+ABC, 4 HQ), 0 kept" in log
    for site in ("fc1 fwd", "fc1 gx", "fc1 gw", "fc2 fwd", "fc2 gx", "fc2 gw"):
        assert f"[0/0] HOT site {site} " in log
    assert "HOT report for graph 0/0" in log  # the hot_decisions artifact: the table
    assert "HOT joint graph" not in log and "HOT forward graph" not in log  # hot_graphs: off unless asked

    trace = "".join(open(trace_dir / name, encoding="utf-8").read() for name in os.listdir(trace_dir))
    # glog-style lines "V1202 12:00:00.000 pid file:line] {metadata}", each followed by its payload
    records = [json.loads(line.split("] ", 1)[1]) for line in trace.splitlines() if not line.startswith("\t")]
    artifacts = {r["artifact"]["name"]: r for r in records if "artifact" in r}
    assert {
        "hot_decisions",
        "hot_joint_graph_before",
        "hot_joint_graph_after",
        "hot_forward_graph",
        "hot_backward_graph",
    } <= set(artifacts)
    assert artifacts["hot_decisions"]["frame_id"] == 0 and artifacts["hot_decisions"]["frame_compile_id"] == 0
    assert '"decision": "HQ"' in trace


def test_explain_a_callable_through_inductor(tmp_path, capsys):
    dump = tmp_path / "dump"
    status = cli.main(["explain", "tests.test_inspect:mlp_step", "--plain", "-o", "policy=hot", "--dump", str(dump)])
    out = capsys.readouterr().out
    print(out)
    assert status == 0
    assert "HOT report for graph 0/0" in out
    assert "6 linear product site(s): 6 rewritten (2 HLA+ABC, 4 HQ), 0 kept" in out
    assert f"dump: {dump / '0_0'}" in out
    assert sorted(os.listdir(dump / "0_0")) == sorted(inspection.DUMP_FILES)
    assert "torch.ops.hot_compile.hq_grad_input.default" in _read(dump / "0_0", "backward.py")


def test_explain_a_script(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch
            from hot_compile import HotConfig
            from tests.models import MLP
            from tests.test_inspect import aot_hot_backend

            assert sys.argv[1:] == ["--steps", "2"], sys.argv
            model = torch.compile(MLP(), backend=aot_hot_backend(HotConfig(policy="hot")))
            for _ in range(int(sys.argv[2])):
                model(torch.randn(2, 32, 32)).sum().backward()
            """
        )
    )
    dump = tmp_path / "dump"
    env_before = os.environ.get("HOT_DUMP_DIR")
    status = cli.main(["explain", "--plain", "--dump", str(dump), str(script), "--", "--steps", "2"])
    out = capsys.readouterr().out
    print(out)
    assert status == 0
    assert out.count("HOT report for graph") == 1  # compiled once, run twice
    assert "fc2" in out and "HQ" in out and "HLA+ABC" in out
    assert (dump / "0_0" / "report.md").exists()
    assert os.environ.get("HOT_DUMP_DIR") == env_before


def _broken_factory():
    return MLP()


@pytest.mark.parametrize(
    "target,message",
    [
        ("nonsense", "must be 'module:callable'"),
        ("no_such_module_for_hot:make", "cannot import module 'no_such_module_for_hot'"),
        ("tests.models:no_such_factory", "has no attribute 'no_such_factory'"),
        ("tests.test_inspect:_broken_factory", "must return (model, example_inputs), got MLP"),
        ("tests.test_inspect:HOT", "not a callable"),
        ("no/such/script.py", "no such file: no/such/script.py"),
        ("no/such/file.py:make", "no such file: no/such/file.py"),
    ],
)
def test_explain_fails_cleanly_on_a_bad_target(target, message, capsys):
    assert cli.main(["explain", target]) == 2
    err = capsys.readouterr().err
    assert "hot-compile explain: error: " in err and message in err
    assert "Traceback" not in err


def test_explain_rejects_bad_options(capsys):
    assert cli.main(["explain", "tests.test_inspect:mlp_step", "-o", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err
    assert cli.main(["explain", "tests.test_inspect:mlp_step", "-o", "rank"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
    assert cli.main(["explain", "--mode", "fastest", "tests.test_inspect:mlp_step"]) == 2
    assert "max-autotune" in capsys.readouterr().err  # names the accepted modes
