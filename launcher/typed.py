"""Build frozen dataclasses from plain dicts (parsed YAML), collecting *every* problem.

Unknown keys and wrong types are errors. Nested dataclasses are built recursively; `list[...]` /
`tuple[...]` / `Optional[...]` / `Union[...]` / `Literal`-free scalars are supported, which is all the
configs use. Ints are accepted where floats are expected; bools are never accepted as ints.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Optional, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """One error listing every problem found in a configuration."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {source}:\n{lines}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str, problems: list[str]) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            out = _convert(value, arg, path, trial)
            if not trial:
                return out
        problems.append(f"{path}={value!r}: expected {' | '.join(_type_name(a) for a in args)}")
        return None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
            return None
        return _build(tp, value, path, problems)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}={value!r}: expected a list")
            return None
        args = get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}={value!r}: expected a mapping")
            return None
        k_tp, v_tp = get_args(tp) or (Any, Any)
        return {_convert(k, k_tp, path, problems): _convert(v, v_tp, f"{path}.{k}", problems) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{path}={value!r}: expected true or false")
        return None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        problems.append(f"{path}={value!r}: expected an integer")
        return None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        problems.append(f"{path}={value!r}: expected a number")
        return None
    if tp is str:
        if isinstance(value, str):
            return value
        problems.append(f"{path}={value!r}: expected a string")
        return None
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    problems.append(f"{path}={value!r}: expected {_type_name(tp)}")
    return None


def _build(cls: type[T], data: dict, path: str, problems: list[str]) -> T:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    for key in unknown:
        where = f"{path}.{key}" if path else key
        problems.append(f"{where}: unknown key (known keys of {cls.__name__}: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        if name in fields:
            kwargs[name] = _convert(value, hints[name], f"{path}.{name}" if path else name, problems)
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for name in missing:
        problems.append(f"{path + '.' if path else ''}{name}: required")
    if problems:
        # Still build something so that later checks can run; fill broken fields with defaults.
        kwargs = {k: v for k, v in kwargs.items() if v is not None or hints[k] is type(None)}
        try:
            return cls(**kwargs)
        except TypeError:
            return None  # type: ignore[return-value]
    return cls(**kwargs)


def build_lenient(cls: type[T], data: dict, prefix: str = "") -> tuple[Optional[T], list[str]]:
    """Build `cls` from `data`, returning (object, problems). Broken fields fall back to their defaults
    so that semantic checks can still run on the rest and every problem is reported at once."""
    if not isinstance(data, dict):
        return None, [f"expected a mapping at the top level, got {type(data).__name__}"]
    problems: list[str] = []
    obj = _build(cls, data, prefix, problems)
    return obj, problems


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
_ = typing  # keep typing importable for get_type_hints on postponed annotations
