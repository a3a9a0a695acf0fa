"""The package's architecture as rules on its source: layers that import only downward, no import
cycles, no file over 400 lines, a cache key that covers exactly what shapes a rewritten graph, and a
README Layout section that names every module."""

import ast
import pathlib
import re

import networkx as nx
import pytest

from hot_compile.inductor_pass import GRAPH_SHAPING_SOURCES

ROOT = pathlib.Path(__file__).parent.parent
PACKAGE, PASSES = ROOT / "hot_compile", ROOT / "passes"

# Lowest first: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("runtime", ("hot_compile.runtime",)),
    ("config", ("hot_compile.config", "hot_compile.plan")),
    ("passes", ("hot_compile.passes",)),
    ("observability", ("hot_compile.observability",)),
    ("api", ("hot_compile.backend", "hot_compile.inductor_pass", "hot_compile.lqs", "hot_compile.device_calibration", "hot_compile")),
    ("harness", ("hot_compile.harness",)),
    ("cli", ("hot_compile.cli",)),
)
MAX_LINES = 400


def _module_name(path: pathlib.Path) -> str:
    if path.is_relative_to(PASSES):
        parts = ("hot_compile", "passes", *path.relative_to(PASSES).with_suffix("").parts)
    else:
        parts = ("hot_compile", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for root in (PACKAGE, PASSES) for p in sorted(root.rglob("*.py"))}


def _layer(module: str) -> int:
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} belongs to no layer of tests/test_layout.py"
    return max(matches)[1]


def _imports(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports, anywhere in its body (function-level imports too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import name` imports pkg.name where that is a module, else pkg itself.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found - {module}


def _import_graph() -> nx.DiGraph:
    sources = _sources()
    graph = nx.DiGraph()
    for module, path in sources.items():
        graph.add_node(module)
        graph.add_edges_from((module, target) for target in _imports(module, path, set(sources)))
    return graph


def test_every_import_points_down_the_layers():
    upward = [
        f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
        for a, b in _import_graph().edges
        if _layer(b) > _layer(a)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = _import_graph()
    # A package's __init__ importing its own submodules is how a package exports them.
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges) if b.startswith(a + ".")])
    assert list(nx.simple_cycles(graph)) == []


def test_the_rules_see_the_imports():
    """The checks above are only as good as the graph: it holds the imports that are known to exist."""
    graph = _import_graph()
    assert graph.has_edge("hot_compile.passes", "hot_compile.runtime.ops")
    assert graph.has_edge("hot_compile.passes.cost_model", "hot_compile.runtime.devices")
    assert graph.has_edge("hot_compile.cli", "hot_compile.harness.bench")  # a function-level import
    assert _layer("hot_compile.harness.tasks.gpt") > _layer("hot_compile") > _layer("hot_compile.passes.sites")


@pytest.mark.parametrize("root", ["hot_compile", "passes", "tests", "tools"])
def test_no_file_over_400_lines(root):
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / root).rglob("*"))
        if p.suffix in (".py", ".cpp", ".sh") and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_cache_key_covers_the_pass_the_runtime_and_the_config_only():
    keyed = {str(p.relative_to(ROOT)) for p in GRAPH_SHAPING_SOURCES}
    expected = {str(p.relative_to(ROOT)) for p in PASSES.glob("*.py")}
    expected |= {str(p.relative_to(ROOT)) for p in (PACKAGE / "runtime").iterdir() if p.suffix in (".py", ".cpp")}
    expected |= {"hot_compile/config.py", "hot_compile/plan.py"}
    assert keyed == expected


def test_readme_layout_names_every_module():
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout") :]
    layout = layout[: layout.find("\n## ", 5)] if "\n## " in layout[5:] else layout
    named = set(re.findall(r"`([\w/.]+)`", layout))
    files = [p for root in (PACKAGE, PASSES) for p in root.rglob("*") if p.suffix in (".py", ".cpp")]
    missing = sorted(
        str(p.relative_to(ROOT))
        for p in files
        if p.name != "__init__.py"
        and p.parent.name != "tasks"  # the tasks are named as one folder
        and p.name not in named
        and str(p.relative_to(ROOT)) not in named
    )
    assert missing == []
    for folder in ("hot_compile/runtime/", "hot_compile/observability/", "hot_compile/harness/", "hot_compile/cli/", "passes/"):
        assert f"`{folder}`" in layout and (ROOT / folder).is_dir()
