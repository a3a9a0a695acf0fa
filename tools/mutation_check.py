"""Do the tests notice when nothing is rewritten? Run them with HOT's site finder stubbed out.

With ``find_linear_sites`` and ``find_conv_sites`` returning no site, training still runs and every graph compiles exactly as
under Inductor, so a test that passes anyway never relied on a rewrite. The stub is a ``.pth`` file in
this environment's site-packages for the length of the run, so that every Python process the tests
start has it too, whatever environment they give it. It notes each test that ran the pass; those
that pass anyway are listed.

    python tools/mutation_check.py                        # the whole suite (as long as `make test`)
    python tools/mutation_check.py tests/test_backend.py  # some files
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).parent.parent

STUB = '''
import importlib.abc, importlib.machinery, os, sys


def _no_sites(graph, *args, **kwargs):
    """No site, and a note of the test that ran the pass (pytest names it in the environment, which
    the processes a test starts inherit)."""
    test, log = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0], os.environ.get("HOT_NO_SITES_LOG")
    if test and log:
        with open(log, "a") as f:
            f.write(test + "\\n")
    return []


_FINDERS = {"hot_compile.passes.sites": "find_linear_sites", "hot_compile.passes.conv_sites": "find_conv_sites"}


class _NoSites(importlib.abc.MetaPathFinder):
    """Stubs each site finder as soon as its module has run, before the driver imports the name."""

    def find_spec(self, name, path, target=None):
        if name not in _FINDERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            setattr(module, _FINDERS[name], _no_sites)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _NoSites())
'''


def run(paths: list[str], xml: pathlib.Path, log: pathlib.Path) -> int:
    site_packages = pathlib.Path(sysconfig.get_paths()["purelib"])
    stub, pth = site_packages / "_hot_no_sites.py", site_packages / "_hot_no_sites.pth"
    stub.write_text(STUB)
    pth.write_text("import _hot_no_sites\n")
    try:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *paths]
        return subprocess.run(command, cwd=ROOT, env=dict(os.environ, HOT_NO_SITES_LOG=str(log))).returncode
    finally:
        pth.unlink()
        stub.unlink()


def outcomes(xml: pathlib.Path) -> dict[str, str]:
    """Every test's outcome ("passed", "failed", "skipped") by node id."""
    found = {}
    for case in ET.parse(xml).iter("testcase"):
        kinds = {child.tag for child in case}
        node_id = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
        found[node_id] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["tests"], help="test files or folders (default: tests)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        xml, log = pathlib.Path(tmp) / "results.xml", pathlib.Path(tmp) / "ran_the_pass.txt"
        log.touch()
        run(args.paths, xml, log)
        results, ran_the_pass = outcomes(xml), set(log.read_text().split())
    counts = collections.Counter(results.values())
    print(f"\nwith no site found: {counts['failed']} failed, {counts['passed']} passed, {counts['skipped']} skipped")
    ran = {t: o for t, o in results.items() if t in ran_the_pass}
    survivors = sorted(t for t, o in ran.items() if o == "passed")
    print(f"tests that ran the HOT pass: {len(ran)}, of which still pass: {len(survivors)}")
    for test in survivors:
        print(f"  {test}")
    others = collections.Counter(t.split("::")[0] for t, o in results.items() if t not in ran_the_pass and o == "passed")
    print("tests that never ran the pass and pass: " + ", ".join(f"{f} {n}" for f, n in sorted(others.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
