"""The one error policy of every command-line entry point, and the guard that keeps outputs off other files.

A CLI's expected failures (a missing folder, a file where a folder is expected, a malformed manifest, a
vocabulary mismatch, an unreadable checkpoint) end as one `error: ...` message on stderr and exit status 2,
never a traceback; `--debug` (anywhere on the command line) or `DEMIX_DEBUG=1` shows the traceback instead.
Unexpected exceptions (bugs) keep their traceback. Lives in data/, the lowest layer, so data/ and launcher/
CLIs share it. The trainer (`launcher.train`, run in every rank) is not wrapped: it reports its input problems
(config, data, checkpoint) as one error itself, and a failure during training keeps its traceback.

`check_output_dir` is the rule that nothing the project did not create is overwritten: an output directory is
either new, or carries a manifest of the format the tool writes, and never is (or holds) the tool's input; a path
that cannot become a directory (a file, a dangling symbolic link) is refused before any work.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pickle
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from data.atomic import output_path_problem

EXIT_USAGE = 2
# What a user's input can cause: bad values and formats (ValueError, incl. JSON and Unicode errors), missing or
# unreadable files (OSError), missing keys of a hand-edited file (LookupError), unreadable tensors (RuntimeError
# from torch.load, UnpicklingError from a weights-only load refusing an object).
EXPECTED: tuple[type[BaseException], ...] = (
    ValueError,
    OSError,
    LookupError,
    RuntimeError,
    pickle.UnpicklingError,
)


class OutputError(ValueError):
    """An output location that would overwrite something the tool did not create, or its own input."""


def _wants_debug(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("DEMIX_DEBUG", "") not in ("", "0")


def cli_main(fn: Callable[..., int]) -> Callable[..., int]:
    """Wrap `main(argv, **kw) -> int`: expected failures become one `error:` message and exit status 2 (see module)."""

    @functools.wraps(fn)
    def main(argv: Sequence[str] | None = None, **kw: Any) -> int:
        args = list(sys.argv[1:] if argv is None else argv)
        debug = _wants_debug(args)
        args = [a for a in args if a != "--debug"]
        try:
            return fn(args, **kw)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except EXPECTED as e:
            if debug:
                raise
            # may be a bug, not input
            hint = " (--debug shows the traceback)" if isinstance(e, RuntimeError) else ""
            print(f"error: {message(e)}{hint}", file=sys.stderr)
            return EXIT_USAGE

    return main


def exit_process(status: int | None) -> NoReturn:
    """`sys.exit(status)` without the interpreter's teardown of every imported module: the atexit callbacks run
    (logging, wandb, multiprocessing, temporary folders) and stdout/stderr are flushed, then the process ends. With
    torch, DeepSpeed (which imports torch._dynamo) and megatron-core loaded, that teardown frees objects one by one
    for ~2 s of CPU per process and writes nothing (experiments/results/make_test_time.md); every rank pays it."""
    import atexit

    atexit._run_exitfuncs()  # noqa: SLF001  (what sys.exit runs first; CPython's, there since Python 2)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said
            pass
    os._exit(0 if status is None else status if isinstance(status, int) else 1)


def message(e: BaseException) -> str:
    """The user-facing text of an exception: its message, with the file name an OSError carries."""
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in str(e.args):
        return f"{e.strerror or type(e).__name__}: {e.filename}"
    if isinstance(e, KeyError):
        return f"missing key {e.args[0]!r}" if e.args else "missing key"
    text = str(e).strip() or type(e).__name__
    return text


def usage_error(e: object) -> int:
    """A command line's refusal: one `error: ...` line on stderr; the exit status 2 (bad input) to return."""
    print(f"error: {e}", file=sys.stderr)
    return 2


class ModuleImportError(ValueError):
    """A Python file given on the command line (`--baseline OLD.py`) that cannot be imported; one line names it."""


def import_module_file(path: str | os.PathLike, option: str, name: str) -> ModuleType:
    """Import the Python file `path` that command-line `option` names (e.g. `--baseline`) as module `name`.

    Whatever stops the import - a missing file, a syntax error, an exception its top level raises (ImportError,
    NameError, RuntimeError, even SystemExit) - is one ModuleImportError naming the option, the file, the error
    and the file's line where it was raised, never a traceback; the half-imported module is not kept."""
    path = str(path)
    if not os.path.isfile(path):
        raise ModuleImportError(f"{option} {path}: no such file")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModuleImportError(f"{option} {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is created
    try:
        spec.loader.exec_module(mod)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - anything the module's top level raises is the module's fault
        raise ModuleImportError(f"{option} {path}: importing it failed: {_import_failure(e, path)}") from None
    finally:
        del sys.modules[name]
    return mod


def _import_failure(e: BaseException, path: str) -> str:
    """`Type: message (line N)`, N the last frame of the traceback inside `path` (a SyntaxError's own line)."""
    raw = e.msg if isinstance(e, SyntaxError) else str(e)
    text = str(raw).strip().splitlines()[0] if str(raw).strip() else ""
    line = e.lineno if isinstance(e, SyntaxError) else None
    if not isinstance(e, SyntaxError):
        frames = [
            f
            for f in traceback.extract_tb(e.__traceback__)
            if os.path.abspath(f.filename) == os.path.abspath(path)
        ]
        line = frames[-1].lineno if frames else None
    return f"{type(e).__name__}{': ' + text if text else ''}{f' (line {line})' if line else ''}"


def read_manifest_format(path: Path) -> str | None:
    """The `format` of a JSON manifest, or None when the file is not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("format") if isinstance(data, dict) else None


def check_output_dir(
    out: Path,
    formats: Sequence[Any],
    will_write: Iterable[str],
    inputs: Iterable[Path] = (),
    manifest: str = "manifest.json",
    what: str = "--out",
) -> None:
    """Refuse (OutputError) an output directory whose existing files the tool did not write, before any work.

    `out` may not exist, or be an empty directory, or hold `manifest` with a format in `formats` (a previous run
    of the same tool: its files are replaced atomically). Otherwise, if any name of `will_write` (relative to
    `out`) exists, it is someone else's file and is not touched. `out` may never be, or lie inside, one of
    `inputs`, nor contain them (writing would replace the input). A path that cannot become a directory - a file,
    a dangling symbolic link, a path under a file (data/atomic.py `output_path_problem`) - is refused here, before
    any work, rather than after it when the output is published."""
    out = Path(out)
    problem = output_path_problem(out)
    if problem is not None:
        raise OutputError(f"{what} {out} {problem}")
    res = out.resolve()
    for src in inputs:
        s = Path(src).resolve()
        if res == s or s in res.parents or (s.is_file() and res in s.parents and s.name in set(will_write)):
            raise OutputError(
                f"{what} {out} would overwrite the input {src}: choose another output directory"
            )
    if not out.is_dir():
        return
    if (out / manifest).is_file():
        fmt = read_manifest_format(out / manifest)
        if fmt in formats:
            return
        raise OutputError(
            f"{what} {out} holds a {manifest} this tool did not write (format {fmt!r}, expected "
            f"{' or '.join(formats)}); choose another output directory, or move that one away"
        )
    clash = sorted(n for n in set(will_write) if (out / n).exists())
    if clash:
        raise OutputError(
            f"{what} {out} already holds {', '.join(clash[:5])} that this tool did not write (no "
            f"{manifest}); choose another output directory, or move them away"
        )
