"""``hot-compile explain TARGET``: compile with the HOT backend, run one training step, and print what
the pass decided for every linear product site.

TARGET is one of:

  module:callable, path/to/file.py:callable
      a callable returning (model, example_inputs), where example_inputs is a tensor, a tuple or list
      of positional arguments, or a dict of keyword arguments. explain compiles the model with
      backend="hot" and runs one forward and backward (the loss is the sum of every output that
      needs a gradient).
  path/to/script.py
      run as __main__ (its arguments after --); the script compiles with backend="hot" itself, and
      every graph it compiles is explained.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import os
import pathlib
import runpy
import sys
import traceback
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from ..backend import backend
from ..config import split_options
from ..observability import inspection

USAGE_ERROR = 2  # argparse's status for a bad command line; a bad TARGET is one


class TargetError(Exception):
    """TARGET or an option names nothing explain can run."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="compile a model with backend='hot', run one step, print the per-site decisions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "target", metavar="TARGET", help="module:callable, path/to/file.py:callable, or path/to/script.py"
    )
    parser.add_argument(
        "script_args",
        nargs="*",
        metavar="ARG",
        help="arguments of a script TARGET, after -- (explain's own options go before TARGET)",
    )
    parser.add_argument("--dump", metavar="DIR", help="write a dump folder per graph into DIR (option dump_dir)")
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a torch.compile option (a HOT key or an Inductor config key); VALUE is a Python literal or a "
        "bare string; repeatable; callable targets only",
    )
    parser.add_argument("--mode", help="torch.compile mode, e.g. max-autotune (callable targets only)")
    parser.add_argument("--plain", action="store_true", help="plain-text tables even where rich could draw them")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    is_script = args.target.endswith(".py")
    try:
        step = _script_step(args) if is_script else _callable_step(args)
    except TargetError as exc:
        print(f"hot-compile explain: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except Exception:
        return _user_error(f"importing {args.target}")
    with inspection.collect() as seen:
        status = step()
    if not seen:
        if status == 0:
            print(
                "hot-compile explain: no graph went through the HOT pass"
                + (" (the script must compile with backend='hot')" if is_script else ""),
                file=sys.stderr,
            )
        return status or 1
    _print(seen, plain=args.plain)
    return status


def _script_step(args: argparse.Namespace) -> Callable[[], int]:
    script = _script_path(args.target)
    if args.option or args.mode:
        raise TargetError("--option and --mode apply to a callable TARGET; a script passes its own to torch.compile")
    return lambda: _run_script(script, args.script_args, args.dump)


def _callable_step(args: argparse.Namespace) -> Callable[[], int]:
    if args.script_args:
        raise TargetError(f"arguments after TARGET ({' '.join(args.script_args)}) are only for a script TARGET")
    options = _parse_options(args.option)
    if args.dump:
        options["dump_dir"] = args.dump
    try:
        config, inductor_options = split_options(options)
        hot = backend(config, mode=args.mode, **inductor_options)
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    factory = _load_callable(args.target)
    return lambda: _run_step(factory, args.target, lambda model: torch.compile(model, backend=hot))


# ---------------------------------------------------------------------------------------------------
# Resolving TARGET


def _parse_options(items: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise TargetError(f"--option {item!r}: expected KEY=VALUE")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text
    return options


def _script_path(text: str) -> pathlib.Path:
    path = pathlib.Path(text)
    if not path.is_file():
        raise TargetError(f"no such file: {text}")
    return path.resolve()


def _load_callable(target: str) -> Callable:
    where, sep, attrs = target.rpartition(":")
    if not sep or not where or not attrs:
        raise TargetError(
            f"TARGET {target!r} must be 'module:callable', 'path/to/file.py:callable' or 'path/to/script.py'"
        )
    module = _import_file(where) if where.endswith(".py") else _import_module(where)
    obj: Any = module
    for attr in attrs.split("."):
        if not hasattr(obj, attr):
            raise TargetError(f"{where!r} has no attribute {attrs!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TargetError(f"{target} is a {type(obj).__name__}, not a callable returning (model, example_inputs)")
    return obj


def _import_module(name: str):
    # Like `python -m`: modules of the current folder are importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise TargetError(f"cannot import module {name!r}: {exc}") from None
        raise


def _import_file(text: str):
    path = _script_path(text)
    # Like `python file.py`: the file's folder comes first on sys.path, for its own imports.
    sys.path.insert(0, str(path.parent))
    # Registered (dataclasses and pickling look their module up) under a name no real module has.
    name = f"_hot_compile_explain_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------
# Running


def _user_error(what: str) -> int:
    traceback.print_exc()
    print(f"hot-compile explain: {what} failed (traceback above)", file=sys.stderr)
    return 1


def _as_call_args(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _loss(output: Any) -> torch.Tensor | None:
    """The sum of every floating-point output that needs a gradient (None if there is none)."""
    parts = [
        t.float().sum()
        for t in pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    return torch.stack(parts).sum() if parts else None


def _run_step(factory: Callable, label: str, compile_model: Callable) -> int:
    try:
        made = factory()
    except Exception:
        return _user_error(f"calling {label}")
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and callable(made[0])):
        got = type(made).__name__
        if isinstance(made, (tuple, list)):
            got += f" of ({', '.join(type(x).__name__ for x in made)})"
        print(f"hot-compile explain: error: {label} must return (model, example_inputs), got {got}", file=sys.stderr)
        return USAGE_ERROR
    model, inputs = made
    args, kwargs = _as_call_args(inputs)
    try:
        loss = _loss(compile_model(model)(*args, **kwargs))
        if loss is None:
            print(f"hot-compile explain: error: no output of {label}'s model needs a gradient", file=sys.stderr)
            return USAGE_ERROR
        loss.backward()
    except Exception:
        return _user_error("the compiled training step")
    return 0


@contextlib.contextmanager
def _as_main(script: pathlib.Path, script_args: list[str], dump: str | None) -> Iterator[None]:
    """sys.argv and sys.path as `python script.py ARGS` sets them, and HOT_DUMP_DIR for every HotConfig
    the script builds; all restored afterwards."""
    saved_argv, saved_path, saved_dump = sys.argv[:], sys.path[:], os.environ.get("HOT_DUMP_DIR")
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.parent))
    if dump:
        os.environ["HOT_DUMP_DIR"] = dump
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_dump is None:
            os.environ.pop("HOT_DUMP_DIR", None)
        else:
            os.environ["HOT_DUMP_DIR"] = saved_dump


def _run_script(script: pathlib.Path, script_args: list[str], dump: str | None) -> int:
    with _as_main(script, script_args, dump):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exit_:
            if exit_.code in (None, 0):
                return 0
            return exit_.code if isinstance(exit_.code, int) else 1
        except Exception:
            return _user_error(f"running {script}")
    return 0


# ---------------------------------------------------------------------------------------------------
# Printing


def _rich_console():
    """A rich console when rich is installed and stdout is a terminal, else None."""
    if not sys.stdout.isatty():
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console()


def _print(seen: list[inspection.InspectedGraph], plain: bool) -> None:
    console = None if plain else _rich_console()
    for i, graph in enumerate(seen):
        if i:
            print()
        if graph.report is None:
            print(f"graph {graph.graph}: the HOT pass failed and left it unchanged ({graph.error})")
        elif console is not None:
            from rich.table import Table

            names, rows = graph.report.cells()
            table = Table(title=f"HOT report for graph {graph.graph}", title_justify="left")
            for name in names:
                # Only the reason may wrap: a wrapped shape or number is hard to read.
                table.add_column(name.replace("_", " "), no_wrap=name != "reason", overflow="fold")
            for row in rows:
                table.add_row(*row)
            console.print(table)
            console.print(inspection.summary(graph.report), highlight=False)
        else:
            print(graph.report.table())
            print(inspection.summary(graph.report))
        if graph.dump is not None:
            print(f"dump: {graph.dump}")
