"""The ``memsafe`` command line.

    memsafe inspect path/to/file.py:function --arg f32[2000,64] --arg f32[20000,64] \\
        [--kwarg k=10] [--svg out.svg] [--html out.html] [--xla-defaults]
    memsafe plan path/to/file.py:function --arg f32[2000,64] --limit 256MiB [--grad]
    memsafe cache info [--dir PATH]
    memsafe cache clear [--dir PATH]

also as ``python -m memsafe``. Name a function as ``file.py:function`` or ``module:function``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_DTYPES = {
    "pred": "bool",
    "bool": "bool",
    "s8": "int8",
    "s16": "int16",
    "s32": "int32",
    "s64": "int64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "c64": "complex64",
    "c128": "complex128",
}
_ARRAY_SPEC = re.compile(r"^\s*([A-Za-z][A-Za-z0-9]*)\[([0-9,\s]*)\]\s*$")


class UsageError(ValueError):
    """Bad command-line input: reported with the usage line, not a traceback."""


def parse_arg(spec: str) -> Any:
    """``f32[2000,64]`` -> a ShapeDtypeStruct; a Python literal (``10``, ``'ij'``) -> itself."""
    import jax
    import numpy as np

    match = _ARRAY_SPEC.match(spec)
    if match:
        name, dims_text = match.groups()
        dtype_name = _DTYPES.get(name.lower(), name.lower())
        try:
            dtype = jax.numpy.dtype(dtype_name)
        except TypeError as err:
            raise UsageError(
                f"unknown dtype {name!r} in --arg {spec!r} (use f32, f64, s32, bf16, c64, ...)"
            ) from err
        dims = [d.strip() for d in dims_text.split(",") if d.strip()]
        if dims_text.strip() and len(dims) != dims_text.count(",") + 1:
            raise UsageError(f"malformed shape in --arg {spec!r}: expected e.g. f32[2000,64]")
        return jax.ShapeDtypeStruct(tuple(int(d) for d in dims), np.dtype(dtype))
    if "[" in spec or "]" in spec:
        raise UsageError(
            f"malformed array --arg {spec!r}: expected DTYPE[D1,D2,...] such as f32[2000,64]"
        )
    try:
        return ast.literal_eval(spec)
    except (ValueError, SyntaxError) as err:
        raise UsageError(
            f"cannot read --arg {spec!r}: give an array as f32[2000,64] or a Python literal "
            "(a number, string, tuple) for a static argument"
        ) from err


def describe_error(err: BaseException) -> str:
    """An error in one line with memsafe's notes after it (where it was tracing, which pass)."""
    notes = [n for n in getattr(err, "__notes__", ()) if n.startswith("memsafe")]
    return "; ".join([f"{type(err).__name__}: {err}", *notes])


def parse_kwarg(spec: str) -> tuple[str, Any]:
    name, sep, value = spec.partition("=")
    if not sep or not name.strip().isidentifier():
        raise UsageError(f"malformed --kwarg {spec!r}: expected NAME=VALUE, e.g. k=10")
    return name.strip(), parse_arg(value)


def load_function(target: str) -> Callable[..., Any]:
    """The function named by ``file.py:function`` or ``package.module:function``."""
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise UsageError(
            f"name the function as FILE.py:FUNCTION or MODULE:FUNCTION, got {target!r}"
        )
    path = Path(where)
    if where.endswith(".py") or path.exists():
        if not path.is_file():
            raise UsageError(f"no such file: {where}")
        name = f"_memsafe_cli_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"cannot load {where} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:
            raise UsageError(f"importing {where} failed: {type(err).__name__}: {err}") from err
    else:
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise UsageError(f"cannot import module {where!r}: {err}") from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{where} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{where}:{attr} is not a function")
    return obj


def _function_arguments(parser: argparse.ArgumentParser) -> None:
    """The function to load and the arguments to trace it at, shared by every command."""
    parser.add_argument("function", help="FILE.py:FUNCTION or MODULE:FUNCTION")
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="SPEC",
        help="a positional argument: an array as DTYPE[D1,...] (f32[2000,64]) or a Python "
        "literal (static); repeat in order",
    )
    parser.add_argument(
        "--kwarg", action="append", default=[], metavar="NAME=SPEC", help="a keyword argument"
    )


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="memsafe", description="Run JAX programs under a memory limit; see where memory goes."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ins = sub.add_parser(
        "inspect",
        help="compile a function and report its kernels, arrays, constants and findings",
        description="Compile FUNCTION at the given argument shapes (nothing is run) and print "
        "where its memory goes.",
    )
    _function_arguments(ins)
    ins.add_argument("--svg", metavar="PATH", help="write the kernel graph as SVG")
    ins.add_argument("--html", metavar="PATH", help="write the report as an HTML page")
    ins.add_argument(
        "--xla-defaults",
        action="store_true",
        help="compile with XLA's default options instead of memsafe's",
    )
    pln = sub.add_parser(
        "plan",
        help="rewrite a function under a memory limit and print what memsafe.jit did",
        description="Trace FUNCTION at the given argument shapes, rewrite and split it under "
        "--limit, verify the footprint with XLA, and print the plan (nothing is run).",
    )
    _function_arguments(pln)
    pln.add_argument(
        "--limit", required=True, metavar="SIZE", help="memory limit: bytes or e.g. 256MiB, 2GB"
    )
    pln.add_argument(
        "--grad", action="store_true", help="also plan the gradient (backward) program"
    )
    cch = sub.add_parser(
        "cache",
        help="show or empty the persistent plan store",
        description="Show or empty memsafe's persistent plan store: the directory given by "
        "--dir, else MEMSAFE_CACHE_DIR.",
    )
    commands = {"inspect": ins, "plan": pln, "cache": cch}
    actions = cch.add_subparsers(dest="action", required=True)
    for action, text in (
        ("info", "print the store's directory, entries, size and bound"),
        ("clear", "remove every entry"),
    ):
        act = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        act.add_argument(
            "--dir", metavar="PATH", help="the store's directory (default: MEMSAFE_CACHE_DIR)"
        )
        commands[f"cache {action}"] = act
    return parser, commands


def _inspect(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from memsafe.inspect import inspect

    try:
        fun = load_function(args.function)
        positional = [parse_arg(a) for a in args.arg]
        keywords = dict(parse_kwarg(k) for k in args.kwarg)
    except UsageError as err:
        parser.error(str(err))
    options = None if args.xla_defaults else "memsafe"
    try:
        report = inspect(fun, *positional, compiler_options=options, **keywords)
    except TypeError as err:  # what jax raises for arguments the function cannot take
        print(f"memsafe inspect: {describe_error(err)}", file=sys.stderr)
        return 1
    print(report)
    try:
        if args.svg:
            Path(args.svg).write_text(report.svg(), encoding="utf-8")
            print(f"\nwrote {args.svg}")
        if args.html:
            report.save(args.html)
            print(f"wrote {args.html}")
    except (OSError, RuntimeError) as err:
        print(f"memsafe inspect: cannot write the report: {err}", file=sys.stderr)
        return 1
    return 0


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import jax

    import memsafe

    try:
        fun = load_function(args.function)
        positional = [parse_arg(a) for a in args.arg]
        keywords = dict(parse_kwarg(k) for k in args.kwarg)
        limit = memsafe.parse_limit(args.limit)
    except (UsageError, ValueError) as err:
        parser.error(str(err))
    static = [i for i, a in enumerate(positional) if not isinstance(a, jax.ShapeDtypeStruct)]
    static_names = [k for k, v in keywords.items() if not isinstance(v, jax.ShapeDtypeStruct)]
    safe = memsafe.jit(fun, memory_limit=limit, static_argnums=static, static_argnames=static_names)
    try:
        print(safe.plan(*positional, **keywords))
        if args.grad:
            print("\ngradient:")
            print(safe.backward_plan(*positional, **keywords))
    except memsafe.MemoryLimitError as err:
        print(f"memsafe plan: {err}", file=sys.stderr)
        return 1
    except TypeError as err:  # what jax raises for arguments the function cannot take
        print(f"memsafe plan: {describe_error(err)}", file=sys.stderr)
        return 1
    return 0


def _cache(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from memsafe import plan_store

    directory = args.dir
    if directory is not None and not directory.strip():
        parser.error("--dir needs a directory")
    where = plan_store.cache_dir() if directory is None else Path(directory).expanduser()
    if where is not None and where.exists() and not where.is_dir():
        parser.error(f"not a directory: {where}")
    try:
        if args.action == "info":
            print(plan_store.info(where))
            return 0
        if where is None:
            parser.error("no store to clear: give --dir PATH or set MEMSAFE_CACHE_DIR")
        removed = plan_store.clear(where)
        left = plan_store.info(where).entries
    except OSError as err:
        print(f"memsafe cache {args.action}: {err}", file=sys.stderr)
        return 1
    print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {where}")
    if left:
        print(f"memsafe cache clear: {left} entries could not be removed", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``memsafe`` and ``python -m memsafe``; returns the exit status."""
    parser, commands = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "inspect":
        return _inspect(args, commands["inspect"])
    if args.command == "plan":
        return _plan(args, commands["plan"])
    if args.command == "cache":
        return _cache(args, commands[f"cache {args.action}"])
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
