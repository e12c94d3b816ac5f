"""Build configs from plain dicts (parsed YAML), reporting *every* problem in one message.

The config classes are pydantic dataclasses (`model.config.CONFIG`): pydantic checks the types, rejects
unknown keys and collects every error. This module adds our one-line messages (dotted paths as `--set`
writes them, the value, what was expected), a lenient build (broken fields dropped, so defaults apply and
the semantic `problems()` checks still run on the rest), and the dict helpers the loaders use.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")
_DROP = object()  # marks a broken entry of the input for the lenient build
_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping",
}


class ConfigError(ValueError):
    """One error listing every problem found in a configuration."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n{lines}")


def _inner(tp: Any) -> Any:
    """Optional[X] -> X."""
    if get_origin(tp) in (Union, types.UnionType):
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


def _message(cls: type, error: dict, prefix: str) -> str:
    loc = [seg for seg in error["loc"] if seg != "[key]"]
    path = prefix
    for seg in loc:
        path = f"{path}[{seg}]" if isinstance(seg, int) else f"{path}.{seg}" if path else str(seg)
    err_type, value = error["type"], error["input"]
    if err_type in ("extra_forbidden", "unexpected_keyword_argument"):
        owner = cls  # the dataclass holding the key: follow the types along the path
        for seg in loc[:-1]:  # a dataclass -> its field's type; list[X] / dict[K, X] -> X
            owner = _inner(owner)
            owner = (
                owner.__pydantic_fields__[seg].annotation
                if dataclasses.is_dataclass(owner)
                else get_args(owner)[-1]
            )
        known = ", ".join(sorted(f.name for f in dataclasses.fields(_inner(owner)) if f.init))
        return f"{path}: unknown key (known keys of {_inner(owner).__name__}: {known})"
    if err_type == "missing":
        return f"{path}: required"
    if err_type == "dataclass_type":
        return f"{path}: expected a mapping for {error['ctx']['class_name']}, got {type(value).__name__}"
    return f"{path}={value!r}: " + (
        f"expected {_EXPECTED[err_type]}" if err_type in _EXPECTED else error["msg"]
    )


def _drop(data: Any, loc: tuple) -> bool:
    """Mark the deepest entry of `data` along `loc` as broken (its container's entry, never the top level)."""
    parent, node = None, data
    for seg in loc:
        in_dict = isinstance(node, dict) and seg in node
        if not (in_dict or isinstance(node, list) and isinstance(seg, int) and seg < len(node)):
            break
        parent, key, node = node, seg, node[seg]
    if parent is not None:
        parent[key] = _DROP
    return parent is not None


def _purge(data: Any) -> Any:
    """A copy of `data` (dicts and lists) without the entries marked broken."""
    if isinstance(data, dict):
        return {k: _purge(v) for k, v in data.items() if v is not _DROP}
    if isinstance(data, list):
        return [_purge(v) for v in data if v is not _DROP]
    return data


def build_lenient(cls: type[T], data: dict, prefix: str = "") -> tuple[T | None, list[str]]:
    """Build `cls` from `data`, returning (object, problems). On problems the object is built from what is
    valid (broken entries dropped, their defaults apply) so that semantic checks can still run and every
    problem is reported at once; it is None when that is impossible (e.g. a required field is broken).
    `prefix` goes before every path in the messages ("model" -> "model.n_layers=...")."""
    if not isinstance(data, dict):
        return None, [f"expected a mapping at the top level, got {type(data).__name__}"]
    adapter = TypeAdapter(cls)
    try:
        return adapter.validate_python(data), []
    except ValidationError as e:
        problems = list(dict.fromkeys(_message(cls, err, prefix) for err in e.errors(include_url=False)))
    data = _purge(data)
    while True:
        try:
            return adapter.validate_python(data), problems
        except ValidationError as e:
            dropped = [_drop(data, err["loc"]) for err in e.errors(include_url=False)]
            if not any(dropped):
                return None, problems
            data = _purge(data)


def from_dict(cls: type[T], data: dict, source: str = "config", prefix: str = "") -> T:
    """Build `cls` from `data`; raise one ConfigError listing every unknown key and type error."""
    obj, problems = build_lenient(cls, data, prefix)
    if problems or obj is None:
        raise ConfigError(problems, source)
    return obj


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists (for YAML/JSON dumps)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def deep_merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, recursively for mappings."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def set_path(data: dict, dotted: str, value: Any) -> None:
    """data['a']['b'] = value for dotted='a.b', creating mappings as needed."""
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ConfigError([f"{dotted}: '{k}' is not a mapping"], "overrides")
    cur[keys[-1]] = value


__all__ = ["ConfigError", "build_lenient", "from_dict", "to_dict", "deep_merge", "set_path"]
