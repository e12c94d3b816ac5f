"""Typed command-line values: the one rule for every number and host name a CLI accepts.

Every numeric option of every CLI (data/, launcher/, benchmarks/, scripts/) is parsed by one of the `Range` types
below (`positive_int`, `nonneg_int`, `random_seed`, `port`, `positive_float`, `open_unit`, ...), so a value outside its
range - a negative count, a zero batch, a top-p of 0, NaN or infinity anywhere - is refused by argparse while it
parses: one `error: argument --x: ...` line, exit status 2, before any file is read. `check_range` is the rule.

Host names (hostfile entries, --include/--exclude, --master-addr, a scheduler's node list) go through `check_host`:
an RFC 1123 name (letters, digits, hyphens, dot-separated labels that neither start nor end with a hyphen) or an
IP address, nothing else. DeepSpeed's runner pastes host names into ssh, pdsh, mpirun and srun command lines
(`ssh {host} hostname` is split into words, so a host named `-oProxyCommand=...` becomes an ssh option that runs
a command on this machine); a name that passes this rule can be neither an option nor more than one word, and
holds no shell metacharacter. Lives in data/, the lowest layer, beside `data/cli.py`, so every CLI can use it.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

Number = int | float


@dataclass(frozen=True)
class Range:
    """An argparse `type=`: parse an int (or a finite float) and require it in [lo, hi] (ends open where asked)."""

    kind: type = int  # int or float
    lo: Number | None = None
    hi: Number | None = None
    lo_open: bool = False
    hi_open: bool = False

    @property
    def __name__(self) -> str:  # argparse names the type in its fallback messages
        return self.describe()

    def describe(self) -> str:
        """'an integer >= 1', 'a finite number in (0, 1]', ..."""
        what = "an integer" if self.kind is int else "a finite number"
        if self.lo is not None and self.hi is not None:
            return (
                f"{what} in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
            )
        if self.lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {self.lo}"
        if self.hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {self.hi}"
        return what

    def __call__(self, text: str) -> Number:
        try:
            value: Number = self.kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}") from None
        problem = check_range(value, self)
        if problem:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()} ({problem})")
        return value

    def parse(self, text: str | Number, what: str) -> Number:
        """The same parse and rule for a value from elsewhere (a key=value string, a file); ValueError naming `what`."""
        try:
            return self(str(text))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{what}={e}") from None


def check_range(value: Number, rng: Range) -> str | None:
    """The rule: why `value` is outside `rng` (not finite, below, above), or None when it is inside."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN and infinity are refused"
    if rng.lo is not None and (value <= rng.lo if rng.lo_open else value < rng.lo):
        return "too small"
    if rng.hi is not None and (value >= rng.hi if rng.hi_open else value > rng.hi):
        return "too large"
    return None


def in_range(value: Number, rng: Range, what: str) -> Number:
    """`value` (from an API call or a file, not argparse) checked by the same rule; ValueError naming `what`."""
    problem = check_range(value, rng)
    if problem:
        raise ValueError(f"{what}={value!r}: must be {rng.describe()} ({problem})")
    return value


positive_int = Range(int, lo=1)  # counts, sizes, steps, batches, blocks, workers, processes
nonneg_int = Range(int, lo=0)  # indices and counts where 0 means "none" (a node rank, top-k 0 = off)
random_seed = Range(int, lo=0, hi=2**32 - 1)  # what numpy's and torch's generators accept
port = Range(int, lo=1, hi=65535)
finite_float = Range(float)
positive_float = Range(float, lo=0, lo_open=True)  # temperatures, seconds, memory, learning rates, tolerances
nonneg_float = Range(float, lo=0)  # caps where 0 means "no cap", an overlapped fraction
open_unit = Range(float, lo=0, hi=1, lo_open=True, hi_open=True)  # (0, 1)
unit_left_open = Range(float, lo=0, hi=1, lo_open=True)  # (0, 1]: top-p, a decay/smoothing factor
unit_right_open = Range(float, lo=0, hi=1, hi_open=True)  # [0, 1): a held-out fraction
unit_closed = Range(float, lo=0, hi=1)  # [0, 1]


# ---------------------------------------------------------------- host names -------------------------------------

_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host_problem(name: str) -> str | None:
    """The rule for host names: why `name` is neither an RFC 1123 host name nor an IP address, or None."""
    if not isinstance(name, str) or not name:
        return "empty"
    try:
        ipaddress.ip_address(name)
        return None
    except ValueError:
        pass
    if len(name) > 253:
        return "longer than 253 characters"
    if name.startswith("-"):
        return "starts with '-' (it would be read as an option)"
    bad = sorted({c for c in name if not (c.isascii() and (c.isalnum() or c in ".-"))})
    if bad:
        return f"contains {', '.join(map(repr, bad))}: a host name has only letters, digits, '-' and '.'"
    if not all(_LABEL.fullmatch(label) for label in name.rstrip(".").split(".")):
        return "each dot-separated label must be 1-63 letters, digits or '-', not starting or ending with '-'"
    return None


def check_host(name: str, what: str = "host") -> str:
    """`name` if it is a host name or an IP address (`host_problem`); else ValueError naming `what` and why."""
    problem = host_problem(name)
    if problem:
        raise ValueError(f"{what} {name!r} is not a host name or IP address: {problem}")
    return name


def _argparse_type(check: Callable[[str, str], str], text: str) -> str:
    """`check(text, "")` as an argparse `type=`: its ValueError becomes argparse's one-line usage error."""
    try:
        return check(text, "")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None


def host(text: str) -> str:
    """argparse `type=` for a host name or IP address (--master-addr)."""
    return _argparse_type(check_host, text)


def check_host_filter(spec: str, what: str = "--include") -> str:
    """`spec` if it is DeepSpeed's host filter (`host[:slot,slot]@host...`) of valid host names and slot
    indices; else ValueError naming `what`."""
    for part in spec.split("@"):
        name, sep, slots = part.partition(":")
        check_host(name, f"{what} {spec!r}: host")
        if sep and not all(s.isdigit() and s.isascii() for s in slots.split(",")):
            raise ValueError(
                f"{what} {spec!r}: slots {slots!r} of {name} are not comma-separated indices (e.g. 0,2)"
            )
    return spec


def host_filter(text: str) -> str:
    """argparse `type=` for --include/--exclude (`check_host_filter`)."""
    return _argparse_type(check_host_filter, text)


__all__ = [
    "Range",
    "check_range",
    "in_range",
    "positive_int",
    "nonneg_int",
    "random_seed",
    "port",
    "finite_float",
    "positive_float",
    "nonneg_float",
    "open_unit",
    "unit_left_open",
    "unit_right_open",
    "unit_closed",
    "host_problem",
    "check_host",
    "host",
    "check_host_filter",
    "host_filter",
]
