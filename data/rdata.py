"""A small reader for R's XDR serialisation (``.rda``/``.rds`` and lazy-load ``.rdb``/``.rdx`` databases), enough
for character vectors, so the demo corpus's Austen novels (data/sources.py) need no extra dependency."""

from __future__ import annotations

import bz2
import lzma
import struct
import zlib
from collections.abc import Iterable
from typing import Any

from data.fetch import decompress


class RSymbol(str):
    """An R symbol (names in pairlists and attributes)."""


class RVector(list):
    """An R vector as a Python list, with its R attributes (names, class, ...) in ``attrs``."""

    def __init__(self, items: Iterable = (), attrs: dict | None = None):
        super().__init__(items)
        self.attrs = attrs or {}

    def named(self) -> dict:
        return dict(zip(self.attrs.get("names", []), self))


class RReader:
    """Reader for R's XDR serialisation format versions 2 and 3 (what ``saveRDS``/``save`` and lazy-load
    databases write). Covers vectors, character strings, pairlists, symbols, environments and references;
    byte code and external pointers raise ValueError. See R's src/main/serialize.c."""

    NIL, ENV_SPECIALS = 254, {253, 252, 251, 250, 242, 241}

    def __init__(self, data: bytes):
        self.buf, self.pos, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation (expected b'X\\n')")
        self.pos = 2
        version = self.int()
        self.int(), self.int()  # writer R version, minimal reader version
        if version == 3:
            nelen = self.int()  # then the native encoding's name
            self.pos += nelen
        elif version != 2:
            raise ValueError(f"unsupported R serialisation version {version}")

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def read(self) -> Any:
        flags = self.int()
        kind, levels = flags & 0xFF, flags >> 12
        has_attr = bool(flags & (1 << 9))  # the tag bit (1 << 10) matters in pairlists only: `_pairlist`
        if kind == self.NIL or kind in self.ENV_SPECIALS:
            return None
        if kind == 255:  # REFSXP
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if kind == 1:  # SYMSXP
            sym = RSymbol(self.read() or "")
            self.refs.append(sym)
            return sym
        if kind in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like
            return self._pairlist(flags)
        if kind == 4:  # ENVSXP
            self.int()
            env: dict = {}
            self.refs.append(env)
            _enclos, frame, hashtab, _attr = self.read(), self.read(), self.read(), self.read()
            for src in [frame] + list(hashtab or []):
                if isinstance(src, dict):
                    env.update(src)
            return env
        if kind in (248, 249, 247):  # PACKAGESXP, NAMESPACESXP, PERSISTSXP: a string vector, referenced
            self.int()
            val = [self.read() for _ in range(self.int())]
            self.refs.append(val)
            return val
        if kind == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            raw = self.buf[self.pos : self.pos + n]
            self.pos += n
            return raw.decode("latin-1" if levels & 4 else "utf-8", errors="replace")
        if kind == 238:  # ALTREP_SXP
            return self._altrep()
        vec = self._vector(kind)
        attrs = self._attributes(self.read()) if has_attr else {}
        return RVector(vec, attrs)

    def _vector(self, kind: int) -> list:
        n = self.length()
        if kind in (10, 13):  # LGLSXP, INTSXP; NA_integer_ is INT_MIN
            vals = struct.unpack_from(f">{n}i", self.buf, self.pos)
            self.pos += 4 * n
            return [None if v == -(2**31) else v for v in vals]
        if kind == 14:  # REALSXP
            vals = struct.unpack_from(f">{n}d", self.buf, self.pos)
            self.pos += 8 * n
            return list(vals)
        if kind == 15:  # CPLXSXP
            vals = struct.unpack_from(f">{2 * n}d", self.buf, self.pos)
            self.pos += 16 * n
            return [complex(vals[i], vals[i + 1]) for i in range(0, 2 * n, 2)]
        if kind in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            return [self.read() for _ in range(n)]
        if kind == 24:  # RAWSXP
            raw = self.buf[self.pos : self.pos + n]
            self.pos += n
            return list(raw)
        raise ValueError(f"unsupported R object type {kind} at byte {self.pos}")

    def _pairlist(self, flags: int) -> dict:
        """A pairlist as {tag: value}; untagged elements get their position as key. Iterative over CDR."""
        out: dict = {}
        while True:
            kind = flags & 0xFF
            if kind == self.NIL:
                return out
            if kind not in (2, 3, 5, 6, 17, 239, 240):
                out[len(out)] = self._read_flagged(flags)
                return out
            if flags & (1 << 9):
                self.read()  # attributes of the pairlist node itself
            tag = self.read() if flags & (1 << 10) else None
            out[str(tag) if tag is not None else len(out)] = self.read()
            flags = self.int()

    def _read_flagged(self, flags: int) -> Any:
        self.pos -= 4
        return self.read()

    @staticmethod
    def _attributes(pairlist: Any) -> dict:
        return {k: v for k, v in (pairlist or {}).items()}

    def _altrep(self) -> Any:
        info, state, attr = self.read(), self.read(), self.read()
        cls = str(list(info.values())[0]) if isinstance(info, dict) and info else ""
        if cls.startswith("wrap_"):
            return RVector(state[0], self._attributes(attr))
        if cls == "compact_intseq":
            n, start, step = (int(x) for x in state[:3])
            return RVector(range(start, start + n * step, step), self._attributes(attr))
        if cls == "compact_realseq":
            n, start, step = state[:3]
            return RVector([start + i * step for i in range(int(n))], self._attributes(attr))
        if cls == "deferred_string":
            return RVector([str(x) for x in (state.get(0) if isinstance(state, dict) else state[0])])
        raise ValueError(f"unsupported ALTREP class {cls!r}")


def r_unserialize(data: bytes) -> Any:
    """Unserialise one R object (possibly compressed, as ``saveRDS`` writes it)."""
    return RReader(decompress(data)).read()


def read_rda(data: bytes) -> dict:
    """Objects saved with R's ``save()`` (a compressed ``RDX2``/``RDX3`` file): {name: value}."""
    raw = decompress(data)
    if raw[:5] not in (b"RDX2\n", b"RDX3\n"):
        raise ValueError("not an R data file (expected RDX2 or RDX3 header)")
    return RReader(raw[5:]).read()


def read_lazyload_db(rdx: bytes, rdb: bytes) -> dict:
    """R's lazy-load database (``data/Rdata.rdx`` index + ``.rdb`` blobs, as installed packages ship their
    data): {name: value}. Each blob is a 4-byte big-endian uncompressed length then zlib data, or for
    compression types 2/3 a type byte ('Z' zlib, '2' bzip2, 'X' xz, '0' none) before the data."""
    index = r_unserialize(rdx).named()
    ctype = (index.get("compressed") or [1])[0]
    out = {}
    for name, (offset, length) in index["variables"].named().items():
        blob = rdb[int(offset) : int(offset) + int(length)]
        body = blob[4:]
        if ctype in (2, 3):
            kind, body = body[:1], body[1:]
            body = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress}.get(kind, bytes)(body)
        else:
            body = zlib.decompress(body)
        out[name] = RReader(body).read()
    return out
