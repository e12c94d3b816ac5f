"""Reading the project's text inputs: one YAML loader and one JSON-object reader, each naming what it read.

* `load_yaml(text, source)` / `read_yaml(path)`: every YAML the project reads (run configs, model presets, `--set`
  values, sweep and cluster files) goes through here. It is PyYAML's safe loader (no `!!python/...` tag builds an
  object), and it refuses a document whose aliases would expand it beyond `MAX_YAML_NODES` nodes (a "billion
  laughs" file of a few hundred bytes otherwise makes every later step - merging, type checks, dumps - walk
  billions of nodes) or that refers to itself. Any problem is an `InputFileError` naming the file or the `--set`
  item, with the line and column: never a YAML traceback.
* `read_json_object(path, shape)`: a JSON file that must hold an object with the given keys and types
  (`{"layout": dict, "config": {"model": {"ffn": dict}}}`); a missing, unparsable or wrongly shaped file is one
  `InputFileError` naming the file and the key.
* `decode_utf8(raw, source)` / `read_text(path)` / `utf8_lines(path)`: text that must be UTF-8; bytes that are not
  are an `InputFileError` naming the file, the line and the byte offset in the file (`not_utf8_at`), as ingest
  reports them.

Lives in data/, the lowest layer, so that data/, model/ and launcher/ share it; `InputFileError` is a ValueError,
so every CLI reports it as one `error:` line (data/cli.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

MAX_YAML_NODES = 100_000  # nodes of a document after alias expansion; a run config has a few hundred


class InputFileError(ValueError):
    """A file (or a command-line value) that cannot be read as what it should be; the message names it."""


# ---------------------------------------------------------------- YAML ------------------------------------------


def yaml_expansion_problem(root: yaml.Node, limit: int = MAX_YAML_NODES) -> str | None:
    """The rule for aliases: why the composed document `root` may not be built (it would have more than `limit`
    nodes once its aliases are expanded, or it contains itself), or None. Each distinct node is visited once
    (sizes memoised), so a bomb is measured in time linear in its text."""
    size: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = (
            [c for pair in node.value for c in pair]
            if isinstance(node, yaml.MappingNode)
            else list(node.value)
            if isinstance(node, yaml.SequenceNode)
            else []
        )
        if done:
            active.discard(key)
            size[key] = min(limit + 1, 1 + sum(size[id(c)] for c in children))
            continue
        if key in size:
            continue
        if key in active:
            return "an alias refers to a node that contains it (a recursive document)"
        active.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)
    if size[id(root)] > limit:
        return f"its aliases expand it beyond {limit:,} nodes (an alias bomb?); write the values out instead"
    return None


class _BudgetLoader(yaml.SafeLoader):
    """The safe loader, refusing a document before it is built when `yaml_expansion_problem` says so."""

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            problem = yaml_expansion_problem(node)
            if problem:
                raise yaml.YAMLError(problem)
        return node


def _yaml_message(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    context, problem = getattr(e, "context", None), getattr(e, "problem", None)
    text = " ".join((f"{context}, {problem}" if context and problem else problem or str(e)).split())
    if "constructor for the tag" in text:
        text += "; tags that build objects (!!python/...) are refused"
    return text + where


def load_yaml(text: str, source: str) -> Any:
    """Parse YAML `text` with the safe, alias-budgeted loader; InputFileError naming `source` (a path, or the
    `--set` item) on any problem."""
    try:
        return yaml.load(text, Loader=_BudgetLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise InputFileError(f"{source} is not valid YAML: {_yaml_message(e)}") from None
    except RecursionError:
        raise InputFileError(f"{source} is not valid YAML: nested too deeply") from None


def read_yaml(path: str | Path) -> Any:
    """The YAML document of file `path` (`load_yaml`); InputFileError naming it when missing or unreadable."""
    return load_yaml(read_text(path), str(Path(path)))


# ---------------------------------------------------------------- UTF-8 ---------------------------------------


def not_utf8_at(raw: bytes, e: UnicodeDecodeError, first_line: int = 1, offset: int = 0) -> tuple[int, str]:
    """(line, "byte offset N: b'...'") of the first non-UTF-8 byte `e` found in `raw`, a piece of a file that
    starts at line `first_line` and byte `offset` of it: the one way every reader names where text is not UTF-8."""
    line = first_line + raw.count(b"\n", 0, e.start)
    return line, f"byte offset {offset + e.start}: {raw[e.start : e.start + 4]!r}"


def decode_utf8(raw: bytes, source: str | Path, first_line: int = 1, offset: int = 0) -> str:
    """`raw` (bytes of file `source` from line `first_line`, byte `offset`) as text; InputFileError
    "SOURCE:LINE: not UTF-8 at byte offset N" (`not_utf8_at`) when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line, where = not_utf8_at(raw, e, first_line, offset)
        raise InputFileError(f"{source}:{line}: not UTF-8 at {where}") from None


def read_text(path: str | Path, what: str = "") -> str:
    """The UTF-8 text of file `path`; InputFileError naming it (and `what` it should be) when missing or
    unreadable, and its line and byte offset when it is not UTF-8."""
    path = Path(path)
    label = f"{path}{f' ({what})' if what else ''}"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputFileError(f"{label}: no such file") from None
    except OSError as e:
        raise InputFileError(f"{label} is unreadable ({e.strerror or e})") from None
    return decode_utf8(raw, path)


def utf8_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of file `path`, read as bytes and decoded one line at a time
    (`decode_utf8`: a non-UTF-8 line is named with its byte offset in the file); OSError when unreadable."""
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            yield n, decode_utf8(raw, path, n, offset)
            offset += len(raw)


# ---------------------------------------------------------------- JSON ------------------------------------------

Shape = Mapping[str, Any]  # key -> type, tuple of types, or a nested Shape (an object); "key?" = optional
_TYPE_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def _type_name(t: Any) -> str:
    return " or ".join(_TYPE_NAMES.get(x, x.__name__) for x in (t if isinstance(t, tuple) else (t,)))


def shape_problems(data: Any, shape: Shape, prefix: str = "") -> list[str]:
    """What in `data` does not have `shape` (missing keys, wrong types), by dotted key."""
    if not isinstance(data, dict):
        return [f"{prefix or 'the top level'} is {type(data).__name__}, expected an object"]
    out = []
    for spec, want in shape.items():
        key, optional = spec.rstrip("?"), spec.endswith("?")
        path = f"{prefix}.{key}" if prefix else key
        if key not in data:
            if not optional:
                out.append(f"{path} is missing")
            continue
        value = data[key]
        if isinstance(want, Mapping):
            out += shape_problems(value, want, path)
            continue
        types = want if isinstance(want, tuple) else (want,)
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok and float in types and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            out.append(
                f"{path} is {json.dumps(value)[:40]} ({type(value).__name__}), expected {_type_name(want)}"
            )
    return out


def read_json(path: str | Path, what: str = "") -> Any:
    """The JSON value of file `path`; InputFileError naming it (and `what` it should be) when missing or not JSON."""
    path = Path(path)
    label = f"{path}{f' ({what})' if what else ''}"
    text = read_text(path, what)
    try:
        return json.loads(text)
    except ValueError as e:
        raise InputFileError(f"{label} is not valid JSON ({e})") from None


def check_shape(data: Any, shape: Shape, path: str | Path, what: str = "") -> None:
    """InputFileError naming file `path` (holding `what`) and every key of `data` that does not have `shape`."""
    problems = shape_problems(data, shape)
    if problems:
        raise InputFileError(
            f"{path}{f' ({what})' if what else ''} does not have the expected shape: {'; '.join(problems)}"
        )


def read_json_object(path: str | Path, shape: Shape | None = None, what: str = "") -> dict[str, Any]:
    """The JSON object of file `path`, checked against `shape` (module docstring; default: any object); one
    InputFileError naming the file and every key that is missing or of the wrong type."""
    data = read_json(path, what)
    check_shape(data, shape or {}, path, what)
    return data


__all__ = [
    "MAX_YAML_NODES",
    "InputFileError",
    "yaml_expansion_problem",
    "load_yaml",
    "read_yaml",
    "shape_problems",
    "check_shape",
    "read_json",
    "read_json_object",
]
